"""A small retrieval-augmented QA set for the blending benchmark (``bench_blend.py serving``).

Eight fictional documents (plain English prose written for this project, ~300-450 tokens
each with the real model's tokenizer), each stating a few distinctive facts (a name, a
number, a date) that appear in that document only, and questions whose answer is one of
those facts. A prompt is an instruction, some documents and a question, joined by the
separator ``SEP_TEXT`` (CacheBlend's default ``blend_special_str``)::

    instruction SEP doc SEP doc ... SEP question

Tokenizer caveat: every part is tokenized on its own, without special tokens, and the id
lists are joined. Tokenizing the joined *text* instead would let BPE merge the
separator's tokens with neighbouring characters (and change a document's first token
depending on the character before it), so a document would not have the same ids inside
a prompt as alone, and neither the separator nor the cached document would be found.
:func:`doc_ids` gives the exact ids a document has inside every prompt: sending them alone
as a completion prompt pre-caches the document.

The judge is lenient on purpose (a 135M model answers in a sentence): an answer is correct
when it contains the fact or one of its aliases, case-insensitively.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

SEP_TEXT = " # # "
INSTRUCTION = "Answer the question using the documents."


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    doc: int
    """Index in ``DOCS`` of the one document stating the answer."""
    answers: tuple[str, ...]
    """The fact first, then aliases; the answer is correct if it contains any of them."""


DOCS: tuple[str, ...] = (
    # 0: a town
    "Brindlemoor is a small market town in the hills above the river Almsey. Brindlemoor was founded in "
    "1742 by a "
    "miller named Tobias Wren, who built the first stone bridge across the river so that farmers could bring "
    "their grain to his mill. The old mill still stands beside the bridge and now holds the town museum, "
    "which displays the original millstones and a map of the valley drawn by Wren himself.\n\n"
    "Today Brindlemoor has a population of 4,318 people. Most of the houses in the centre have roofs of blue "
    "slate, cut from a quarry on the northern side of the valley, and visitors often say the town looks like "
    "a painting when it rains. The current mayor of Brindlemoor is Edith Carrow, a former schoolteacher who "
    "is known for riding her bicycle to every council meeting.\n\n"
    "The most famous event in the town is the Lantern Fair, held every year on the second weekend of "
    "October. During the fair, children carry paper lanterns shaped like fish along the river path, and the "
    "bakers of the town sell a spiced pear cake that is made only for those two days. The fair ends with a "
    "concert on the bridge, and the last song is always the same old folk tune, called The Miller's Daughter.\n\n"
    "The town has one school, one railway station and a weekly market on Thursdays, where shepherds from the "
    "upper valley sell wool and cheese. A local saying claims that anyone who crosses the Wren bridge three "
    "times in one day will return to Brindlemoor before the year is over. Walkers who follow the river path "
    "downstream for an hour reach a ruined chapel, where owls nest in the bell tower and wild roses cover the "
    "broken walls every summer.",
    # 1: a company
    "Quillfeather Instruments is a company that makes barometers, compasses and other weather instruments. "
    "Quillfeather Instruments was founded by Margarethe Voss, an engineer, in 1968 in the port city of "
    "Harrowgate. Voss had "
    "worked for many years repairing the instruments of fishing boats, and she believed that sailors deserved "
    "tools that would not break in a storm. Her first workshop was a rented room above a rope shop on the "
    "harbour.\n\n"
    "The brass barometer made by Quillfeather Instruments is called the Stormglass 9. It was released in "
    "1981 and is still sold today, almost unchanged. Sailors like it because its needle is painted bright "
    "orange and can be read from across a dark cabin. More than 90,000 units of the Stormglass 9 have been "
    "sold around the world.\n\n"
    "212 people work at Quillfeather Instruments. Its factory moved in 1994 to a larger building on the "
    "edge of Harrowgate, next to the old lighthouse, and the company logo still shows a feather crossed with "
    "a compass needle. The current chief executive is Daniel Okafor, who joined the company as an apprentice "
    "when he was seventeen years old.\n\n"
    "Every spring the company runs a free course for young people who want to learn how to repair "
    "instruments. The course lasts six weeks, and the best student of each year receives a small silver "
    "compass engraved with the words Steady Hands. Margarethe Voss retired in 1999, but she is said to have "
    "visited the factory every Friday until she was ninety. Each instrument leaves the factory with a card "
    "signed by the person who tested it, and customers sometimes write letters to thank that person by name "
    "after a difficult voyage.",
    # 2: an expedition
    "The Kestrel Expedition was a journey to the Varn Glacier in the far north, which set out in the summer "
    "of 1911. It was led by Captain Alaric Dunmore, a naval officer who had already spent two winters in the "
    "Arctic. The expedition sailed on a wooden ship named the Northern Thistle, which had been built for "
    "whaling and strengthened with oak beams to survive the ice.\n\n"
    "The party was made up of fourteen men, including a doctor, two geologists, a cook and a photographer "
    "named Elsa Brandt. Elsa Brandt was the only woman to join any polar expedition of that decade. Her glass plate "
    "photographs of the glacier are now kept in a museum and show the ice cliffs in remarkable detail. The "
    "expedition also took thirty sled dogs. The lead sled dog of the Kestrel Expedition was a grey husky "
    "named Pepper.\n\n"
    "After a hard winter in a hut on the edge of the glacier, Dunmore and four companions climbed to the "
    "summit of Mount Orrin on 3 March 1912. They were the first people to reach the top, and they left a "
    "copper box there with their names and a short letter. The box was found again in 1964 by a team of "
    "climbers, and the letter was still readable.\n\n"
    "The expedition returned home in the autumn of 1912 without losing a single man. Captain Dunmore later "
    "wrote a book about the journey, called Ice and Silence, which became a popular adventure story for "
    "children. The Northern Thistle itself was sold to a fishing company and sank in a storm many years later. "
    "A small memorial stone near the harbour where the expedition began lists the names of all the men, and "
    "every year a wreath of heather is laid there on the anniversary of their return.",
    # 3: an island
    "Serra Lume is a small island in a warm southern sea, about forty kilometres from the mainland. Serra "
    "Lume is famous for its saffron, which grows on terraced fields on the slopes of an old volcano called Monte "
    "Ciro. Every autumn the purple flowers are picked by hand at dawn, and the red threads are dried over "
    "charcoal fires in the villages.\n\n"
    "The island has about 2,700 inhabitants, who live in three villages. The largest village, Porto Vela, has "
    "a harbour where two ferries arrive each day from the mainland. The crossing takes two hours and ten "
    "minutes when the sea is calm. There are no cars on Serra Lume; people travel by foot, by bicycle or on "
    "the backs of donkeys, and the island has more donkeys than bicycles.\n\n"
    "On the western cape stands a white lighthouse that was built in 1893. Its last keeper was a woman named "
    "Rosalind Ferro, who kept the light burning for thirty-one years and who wrote a diary about every ship "
    "that passed the cape. When the light was made automatic in 1972, she moved into a cottage in Porto Vela "
    "and opened a small library in her front room.\n\n"
    "The island celebrates the Feast of the Saffron Moon on the first full moon of November. On that night the "
    "villagers cook a golden rice dish in a huge iron pan in the square of Porto Vela, and everyone on the "
    "island, including visitors, is invited to share it. Fishermen say that the saffron of Serra Lume is so "
    "strong that a single thread can colour a whole pot of soup. In spring the hills are covered with wild "
    "thyme and lemon trees, and the island's honey, though sold only in the village shops, is said to taste "
    "faintly of both.",
    # 4: an orchestra
    "The Calloway Philharmonic is an orchestra based in the city of Linmouth. It gave its first concert in "
    "1923, in a cinema that had been borrowed for the evening, and it played only four pieces because the "
    "musicians had not had time to rehearse more. Since 1958 the orchestra has performed in its own hall. "
    "The concert hall of the Calloway Philharmonic is called Ashgrove Hall. Ashgrove Hall has a ceiling of carved cedar wood and seats 1,640 listeners.\n\n"
    "The orchestra has 87 musicians. Its principal conductor is Ines Marlowe, who took up the post in 2016 "
    "and is the first woman to lead the orchestra. Before coming to Linmouth she played the viola for ten "
    "years, and she still likes to join the viola section when the orchestra plays chamber music.\n\n"
    "Each season the Calloway Philharmonic gives forty concerts, and one of them is always a free open-air "
    "concert in Fenwick Park on the longest day of the year. The orchestra is also known for its prized "
    "instrument, a cello made in 1734 that is called the Duchess. It is played by the principal cellist, "
    "Tomas Hale, and it is insured for a very large sum.\n\n"
    "The orchestra has recorded more than sixty albums. Its best known recording is of a symphony written "
    "by a local composer, Agnes Pruett, called The Linmouth Tides, which describes the sea rising and falling "
    "in the harbour of the city. Every new musician who joins the orchestra is given a small brass badge in "
    "the shape of a tuning fork on the first day of rehearsals. Children from the schools of the city may "
    "attend the final rehearsal of each concert for free, sitting on cushions in the aisles and watching the "
    "musicians stop and start again.",
    # 5: a bakery
    "The Copper Kettle is a bakery on Marrow Lane in the old quarter of the city of Dunhallow. The Copper "
    "Kettle was opened in 1896 by two brothers, Felix and Otto Brannigan. The brothers had learned to bake in their grandmother's "
    "kitchen. The brothers built the brick oven themselves, and the same oven is still used every morning, "
    "more than a hundred years later.\n\n"
    "The bakery is best known for its rye honey loaf, a dark bread sweetened with heather honey from the "
    "hills outside the city. The recipe has never been written down; it is taught by each head baker to the "
    "next. The Copper Kettle bakes 350 loaves every day, and on Saturdays a queue forms outside the door "
    "before six in the morning.\n\n"
    "The current head baker is Miriam Achterberg, who started working at the bakery as a girl of fifteen, "
    "washing trays and sweeping the floor. She became head baker in 2008. Under her care the bakery added a "
    "small cafe with six tables, where customers can eat a slice of plum tart with a cup of strong tea. The "
    "walls of the cafe are covered with old photographs of the Brannigan family.\n\n"
    "Every year on the ninth of February, the anniversary of the opening, the bakery gives a free loaf to the "
    "first hundred customers. A copper kettle that belonged to the brothers hangs above the counter, and the "
    "bakers say it has been polished every single day since the shop opened. The cat of The Copper "
    "Kettle bakery is named Crumb; Crumb sleeps in the window in the afternoons and is known to most of the neighbourhood. In winter the bakery also sells "
    "small ginger biscuits shaped like stars, and the smell of them drifts down the whole of the lane on cold "
    "mornings.",
    # 6: a space probe
    "Halcyon-3 is a small robotic space probe that was launched on 14 May 2031 to study an asteroid called "
    "Pemberly. The probe was built by a team of about two hundred engineers and scientists, and the mission "
    "was directed by Dr. Yusuf Adeyemi, who had worked on two earlier probes. Halcyon-3 left Earth on a rocket "
    "from the Tarrow Point launch site, on a cold but clear morning.\n\n"
    "Pemberly is a rocky asteroid about 900 metres across, shaped a little like a peanut. It turns once every "
    "seven hours. Scientists chose it because its surface seemed to contain clay, which could hold water "
    "locked inside its minerals. Halcyon-3 needed almost three years to reach the asteroid, travelling more "
    "than 600 million kilometres.\n\n"
    "The probe weighs 780 kilograms and carries four instruments: a camera, a spectrometer, a small radar "
    "and a dust collector. Its solar panels, when unfolded, are as wide as a tennis court. The most daring "
    "part of the mission was a touch-and-go landing, in which the probe touched the surface for only six "
    "seconds to collect a handful of dust.\n\n"
    "The sample capsule returned to Earth and landed in a desert on 2 December 2036. When the capsule was "
    "opened, the scientists found tiny grains of clay, just as they had hoped. The mission team named the "
    "largest crater they had photographed on Pemberly after the engineer Lotte Sandvik, who had designed the "
    "dust collector but died before the launch. Part of the sample was later sent to laboratories in several "
    "countries, and a single grain is displayed in a glass case in a museum, where children can look at it "
    "through a microscope.",
    # 7: an animal
    "The silver-crested marsh owl is a rare bird that lives only in the reed beds of the Ottery Marshes. It was "
    "first described in 1853 by a naturalist named Cornelius Fairweather. Cornelius Fairweather saw one hunting at dusk and "
    "wrote that it flew as silently as falling snow. The owl gets its name from a band of pale silver "
    "feathers on top of its head, which shine in moonlight.\n\n"
    "The owl is small, with a wingspan of about 62 centimetres, and it feeds mostly on water voles and frogs. "
    "Unlike most owls, it builds its nest on the ground, hidden among thick reeds, and the female lays "
    "between two and four eggs in April. The young owls leave the nest after about five weeks but stay "
    "close to their parents until the autumn.\n\n"
    "For many years the owl was in danger, because parts of the marshes were drained for farmland. In 1990 "
    "only 46 breeding pairs were counted. A nature reserve was then created, led by a warden named Harriet "
    "Quinlan, who spent twenty years restoring the reed beds and blocking the old drainage ditches. By the "
    "last count there were 310 breeding pairs, and the number is still rising.\n\n"
    "Visitors to the reserve can watch the owls from a wooden hide built on stilts above the water. The call "
    "of the silver-crested marsh owl is a soft double whistle. Local people call the silver-crested marsh owl "
    "the reed ghost. "
    "The reserve is closed to visitors during the nesting season, from March to June, so that the birds are "
    "not disturbed. Painters and photographers come to the marshes in autumn, when the reeds turn gold and "
    "the owls can sometimes be seen perched on old fence posts at sunset, watching the water for movement.",
)

QUESTIONS: tuple[Question, ...] = (
    Question("Who founded the town of Brindlemoor?", 0, ("Tobias Wren", "Wren")),
    Question("What is the population of Brindlemoor?", 0, ("4,318", "4318")),
    Question("Who is the mayor of Brindlemoor?", 0, ("Edith Carrow", "Carrow")),
    Question("In which year was Brindlemoor founded?", 0, ("1742",)),
    Question("Who founded Quillfeather Instruments?", 1, ("Margarethe Voss", "Voss")),
    Question("What is the name of the brass barometer made by Quillfeather Instruments?", 1,
             ("Stormglass 9", "Stormglass")),
    Question("How many people work at Quillfeather Instruments?", 1, ("212",)),
    Question("Who is the chief executive of Quillfeather Instruments?", 1, ("Daniel Okafor", "Okafor")),
    Question("Who led the Kestrel Expedition?", 2, ("Alaric Dunmore", "Dunmore")),
    Question("What was the name of the ship of the Kestrel Expedition?", 2, ("Northern Thistle",)),
    Question("Who was the photographer of the Kestrel Expedition?", 2, ("Elsa Brandt", "Brandt")),
    Question("What was the name of the lead sled dog of the Kestrel Expedition?", 2, ("Pepper",)),
    Question("What is Serra Lume famous for?", 3, ("saffron",)),
    Question("Who was the last keeper of the lighthouse on Serra Lume?", 3, ("Rosalind Ferro", "Ferro")),
    Question("What is the name of the largest village on Serra Lume?", 3, ("Porto Vela",)),
    Question("Who is the principal conductor of the Calloway Philharmonic?", 4, ("Ines Marlowe", "Marlowe")),
    Question("How many musicians does the Calloway Philharmonic have?", 4, ("87", "eighty-seven")),
    Question("What is the name of the concert hall of the Calloway Philharmonic?", 4, ("Ashgrove Hall", "Ashgrove")),
    Question("Who opened The Copper Kettle bakery in 1896?", 5, ("Brannigan",)),
    Question("Who is the head baker of The Copper Kettle?", 5, ("Miriam Achterberg", "Achterberg")),
    Question("What is the name of the cat at The Copper Kettle bakery?", 5, ("Crumb",)),
    Question("Which asteroid did the Halcyon-3 probe study?", 6, ("Pemberly",)),
    Question("Who directed the Halcyon-3 mission?", 6, ("Yusuf Adeyemi", "Adeyemi")),
    Question("How much does the Halcyon-3 probe weigh?", 6, ("780",)),
    Question("Who first described the silver-crested marsh owl?", 7, ("Cornelius Fairweather", "Fairweather")),
    Question("Where does the silver-crested marsh owl live?", 7, ("Ottery Marshes", "Ottery")),
    Question("What do local people call the silver-crested marsh owl?", 7, ("reed ghost",)),
    Question("Who was the warden of the owl nature reserve?", 7, ("Harriet Quinlan", "Quinlan")),
)  # fmt: skip


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def sep_ids(tokenizer: Any) -> list[int]:
    """The separator's ids (``SEP_TEXT`` tokenized alone, without special tokens)."""
    return _ids(tokenizer, SEP_TEXT)


def doc_ids(tokenizer: Any, doc: int | str) -> list[int]:
    """The ids document ``doc`` (an index in ``DOCS`` or a text) has inside every prompt."""
    return _ids(tokenizer, DOCS[doc] if isinstance(doc, int) else doc)


def chat_wrapper(tokenizer: Any) -> tuple[str, str]:
    """The text the tokenizer's chat template puts before and after one user message (ending with the
    assistant's turn), or ``("", "")`` without a template. An instruct model answers inside its own
    turn; given the bare text, SmolLM2-135M-Instruct mostly ends its answer at once."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    marker = "\x00MESSAGE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    before, _, after = text.partition(marker)
    return before, after


def build_prompt(tokenizer: Any, docs_order: Sequence[int], question: Question | str) -> list[int]:
    """Token ids of ``INSTRUCTION SEP doc SEP doc ... SEP Question: ...\nAnswer:``, inside the chat
    template's user turn (:func:`chat_wrapper`) when the tokenizer has one.

    Every part is tokenized on its own and the id lists are joined (see the module's
    tokenizer caveat), so each document's ids equal :func:`doc_ids`.
    """
    text = question.text if isinstance(question, Question) else question
    before, after = chat_wrapper(tokenizer)
    sep = sep_ids(tokenizer)
    ids = _ids(tokenizer, before + INSTRUCTION)
    for d in docs_order:
        ids += sep + doc_ids(tokenizer, d)
    return ids + sep + _ids(tokenizer, f"Question: {text}{after}")


def docs_for(question_index: int, num_docs: int, seed: int = 0) -> list[int]:
    """A document order for question ``question_index``: ``num_docs`` documents including the answer's,
    drawn and shuffled with a seed of their own, so consecutive prompts order documents differently."""
    import random

    if not 1 <= num_docs <= len(DOCS):
        raise ValueError(f"num_docs={num_docs}: expected 1..{len(DOCS)}")
    q = QUESTIONS[question_index]
    rng = random.Random(seed * 100_003 + question_index)
    others = [d for d in range(len(DOCS)) if d != q.doc]
    order = [q.doc, *rng.sample(others, num_docs - 1)]
    rng.shuffle(order)
    return order


def judge(answer: str, question: Question) -> bool:
    """True if ``answer`` contains the fact or one of its aliases (case-insensitive)."""
    low = answer.lower()
    return any(a.lower() in low for a in question.answers)


def rouge_l(a: str, b: str) -> float:
    """ROUGE-L F-measure (beta 1) of two texts: longest common subsequence of whitespace tokens."""
    x, y = a.split(), b.split()
    if not x or not y:
        return float(x == y)
    prev = [0] * (len(y) + 1)
    for xi in x:
        cur = [0]
        for j, yj in enumerate(y):
            cur.append(prev[j] + 1 if xi == yj else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(x), lcs / len(y)
    return 2 * precision * recall / (precision + recall)
