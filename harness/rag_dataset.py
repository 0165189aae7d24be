"""A small retrieval-augmented QA set for the blending benchmark (``bench_blend.py serving``).

Sixteen fictional documents (plain English prose written for this project, about 360-390 tokens
each with the real model's tokenizer, the appended ones 360-380), each stating distinctive
facts (a name, a number, a date) that appear in that document only, and 117 questions whose
answer is one of those facts (never a word of the question itself). The documents come in
groups of ``GROUP`` (eight): a prompt's documents are drawn from the group of its answer's
document (:func:`docs_for`), so the prompts of the first group's questions are those of the
original eight-document set. Documents and questions are only ever appended: tests and
earlier measurements refer to them by index. A prompt is an instruction, some documents and
a question, joined by the separator ``SEP_TEXT`` (CacheBlend's default ``blend_special_str``)::

    instruction SEP doc SEP doc ... SEP question

Tokenizer caveat: every part is tokenized on its own, without special tokens, and the id
lists are joined. Tokenizing the joined *text* instead would let BPE merge the
separator's tokens with neighbouring characters (and change a document's first token
depending on the character before it), so a document would not have the same ids inside
a prompt as alone, and neither the separator nor the cached document would be found.
:func:`doc_ids` gives the exact ids a document has inside every prompt: sending them alone
as a completion prompt pre-caches the document.

The judge is lenient on purpose (a 135M model answers in a sentence): an answer is correct
when it contains the fact or one of its aliases, case-insensitively. :func:`gold_answer` is the
answer a teacher-forced score conditions on: the question restated (its ``lead``), then the fact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

SEP_TEXT = " # # "
INSTRUCTION = "Answer the question using the documents."
GROUP = 8
"""Documents per group: a prompt holds documents of one group only (:func:`docs_for`)."""
ANSWER_LEAD = "The answer is"
"""How a teacher-forced gold answer starts (:func:`gold_answer`)."""


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    doc: int
    """Index in ``DOCS`` of the one document stating the answer."""
    answers: tuple[str, ...]
    """The fact first, then aliases; the answer is correct if it contains any of them."""
    lead: str = ""
    """The answer's words before the fact, as a sentence restating the question (``The mayor of
    Brindlemoor is``): the context a teacher-forced score gives the fact (:func:`gold_answer`)."""


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
    # ---- group 2 (documents 8-15), appended; prompts draw their documents from one group
    # 8: a mountain railway
    "The Glenvarrow Mountain Railway is a narrow rack railway that climbs from the lakeside village of "
    "Ardmuir to the summit of Ben Corrach. The railway was opened in 1897, and its steep line was designed by "
    "an engineer named Hector Lindqvist, who had built bridges in Norway before he came to the valley. The "
    "line is 7.4 kilometres long and climbs more than a thousand metres, and on the steepest section the "
    "track rises one metre for every four travelled.\n\n"
    "The railway owns five steam locomotives, all painted dark green with red wheels. The oldest of them, "
    "called Snowdrop, still pulls the first train of the season every May. Each locomotive pushes a single "
    "carriage up the mountain rather than pulling it, so that the engine is always below the passengers if "
    "a coupling breaks. A journey to the summit takes fifty-five minutes, and the trains run only between "
    "May and October, because the upper line is buried in snow for the rest of the year.\n\n"
    "Halfway up the mountain the trains stop at a passing loop called Raven's Ledge, where passengers can buy "
    "hot soup from a small hut. At the top stands the Summit Hotel, a stone building with twelve rooms, whose "
    "manager is Fiona Strachan. On a clear day, visitors can see four lakes and the distant sea from its "
    "terrace.\n\n"
    "In 1956 the railway almost closed after a landslide destroyed part of the track. A group of volunteers, "
    "led by a retired signalman named Walter Pryce, raised the money to repair it, and their society still "
    "helps to run the railway today. Every year the railway carries about 120,000 passengers. On the last day "
    "of the season the drivers blow their whistles together at noon, and the sound can be heard across the "
    "whole valley.",
    # 9: a botanical garden
    "The Caswick Botanical Garden lies on the southern edge of the city of Caswick, on land that once belonged "
    "to a wool merchant. The garden was founded in 1863 by the botanist Augusta Pellinore, who left her house, "
    "her library and eleven acres of land to the city on the condition that the gates would never charge an "
    "entrance fee. The gates are still free today, and more than half a million people walk through them "
    "every year.\n\n"
    "The heart of the garden is a great iron and glass greenhouse known as the Crystal Fern House. It was "
    "built in 1889 and is heated by a boiler that burns wood from the garden's own fallen trees. Inside grows "
    "the garden's most famous plant, a rare orchid with pale blue petals called the Moonlit Slipper, which "
    "flowers for only nine days each year, usually in late January. When it opens, the queue of visitors "
    "sometimes reaches the main road.\n\n"
    "The garden holds 14,600 different kinds of plants. Its seed bank, in a cool cellar beneath the old "
    "house, keeps the seeds of mountain flowers that no longer grow in the wild. The current director of the "
    "garden is Dr. Samuel Okonjo, a specialist in desert plants, and the head gardener is Beatrix Hollis, "
    "who has worked in the garden for thirty-four years.\n\n"
    "Near the lake there is a tall monkey puzzle tree planted by Augusta Pellinore herself, and children are "
    "told that it is the oldest living thing in the city. On summer evenings the garden holds small concerts "
    "on the lawn beside the lake, and every autumn it runs a market where gardeners can swap seeds, cuttings "
    "and advice about difficult soils. A small tea room near the gates serves scones with jam made from the "
    "quinces of the garden's own orchard.",
    # 10: a newspaper
    "The Kelderby Herald is a weekly newspaper printed in the market town of Kelderby. Its first issue "
    "appeared in the spring of 1852 and cost one penny. The newspaper was founded by a printer named Josiah "
    "Penhallow, who printed the early issues on a hand press in the back room of his stationery shop. That "
    "press, known to the staff as Old Growler because of the noise it made, is still on show in the front "
    "office, and it is oiled once a year by the youngest reporter.\n\n"
    "The Herald sells about 9,250 copies every week, which makes it one of the few small newspapers that "
    "still earns a profit. Its editor is Clara Venning, who started as a junior reporter covering flower "
    "shows and cattle sales and became editor in 2015. She insists that every story about the town must "
    "include the name of at least one person who lives there.\n\n"
    "The most famous story in the history of the paper came in 1934, when a farmer ploughing a field found a "
    "clay pot full of silver coins. A reporter of the Herald reached the farm before the police did, and "
    "the treasure has been known ever since as the Millbeck Hoard, after the name of the farm. The coins are "
    "now in a museum in the capital.\n\n"
    "Every week the paper prints a puzzle column of riddles about the town, written by the same anonymous "
    "author since 1979 under the pen name Inkwell. Readers have tried for decades to guess who Inkwell is, "
    "and the editor has promised that the secret will be revealed only when the author dies. Old copies of "
    "the Herald are bound in leather volumes and kept in the town library, where anyone may read them for "
    "free on weekday afternoons.",
    # 11: a tea estate
    "Ambervale is a tea estate on the misty slopes of the Kalindra Hills, at a height of about 1,900 metres. "
    "It was planted in 1908 by a Scottish planter named Duncan Farquhar, who cleared the forest with the help "
    "of workers from the villages below and built the first drying sheds out of teak. Today the estate "
    "covers 520 hectares and employs around a thousand pickers and factory workers, most of whom live in "
    "small houses on the estate with their families.\n\n"
    "The tea of Ambervale is picked by hand every nine days. The most valued tea is the first flush, picked "
    "in March, which has a light colour and a taste of apricots. The best known blend of the estate is sold "
    "under the name Silver Cloud, and a single kilogram of it once sold at auction for a record price. The "
    "leaves are withered, rolled and dried in a factory beside a waterfall, whose water once turned the "
    "rolling machines.\n\n"
    "The estate manager is Priya Raman, the first woman to run Ambervale. She introduced organic farming in "
    "2012 and planted rows of lemongrass between the tea bushes to keep away insects. The estate has its own "
    "school and a small hospital, and a bell is rung at six every morning to call the pickers to the "
    "fields.\n\n"
    "A narrow road with forty-two hairpin bends leads up to Ambervale from the town below, and visitors often "
    "stop at a viewpoint called Tiger's Seat, where a tiger was once seen sleeping on a rock. Guests can stay "
    "in the old bungalow of the founder, which has a wide veranda looking out over the clouds, and in the "
    "evening they are served a pot of the estate's own tea with sweet cardamom biscuits.",
    # 12: a glassworks
    "The Solvik Glassworks stands at the mouth of a fjord on the west coast, in a village of the same name. "
    "It was founded in 1823 by the brothers Anders and Lars Holmqvist, who had learned to blow glass in "
    "Bohemia. For more than a century the glassworks made bottles and window panes, but today it is known "
    "for its hand-blown vases in a deep green colour called fjord green, made by adding a little copper and "
    "iron to the sand.\n\n"
    "The furnace of the glassworks has not gone out since 1946. It is fed with gas today, but the workers "
    "still call it the Dragon, as their grandparents did. Nineteen glassblowers work at Solvik, and an "
    "apprentice must train for seven years before being allowed to sign a piece. The master glassblower is "
    "Ingrid Solheim, who learned the craft from her father and is famous for vases with air bubbles trapped "
    "in spirals.\n\n"
    "The most famous object ever made at Solvik is the Winter Chandelier, which has 2,400 glass drops and "
    "hangs in the parliament building of the capital. It took eleven months to make. In 1958 the glassworks "
    "was nearly destroyed by a fire that started in the packing room, but the furnace itself was saved by a "
    "foreman, Erik Dahl, who stayed behind to close the gas valves.\n\n"
    "Visitors may watch the glassblowers from a gallery above the workshop floor. In the shop, pieces with "
    "small faults are sold cheaply as seconds, and collectors arrive early on the first Saturday of each "
    "month, when new seconds are put out. Every winter the glassworks hangs a glass star in each window of "
    "the village, and the children are allowed to choose the colour of their own star.",
    # 13: a rowing club
    "The Tarnwick Rowing Club is one of the oldest rowing clubs on the river Lisle. It was formed in 1867 by "
    "six clerks from a shipping office, who bought an old racing boat from a university crew and repaired it "
    "in a coal shed. The boathouse of the club, built in 1884 of red brick, still has its original wooden "
    "racks, and the names of every club captain are painted in gold on a board above the door.\n\n"
    "The club colours are maroon and sky blue, and the oars of its boats are painted maroon with a single "
    "blue stripe. Its most famous boat is an eight named the Heron, which won the Grand Challenge Trophy at "
    "the Lisle Regatta three times in a row, from 1928 to 1930. The Heron now hangs from the ceiling of the "
    "boathouse.\n\n"
    "Each year in March the club races its old rival, the Fallowfield Boat Club, over a course of four miles "
    "from the railway bridge to the brewery steps. The winning crew keeps a silver cup called the Tankard for "
    "a year, and the losing crew must row the winners across the river in the evening. Tarnwick has won the "
    "race 38 times.\n\n"
    "The current captain is Nadia Kowalczyk, who rowed for her country at two Olympic Games. The coach of "
    "the club, a retired boatbuilder named Percy Ellwood, has trained its crews for twenty-six years and is "
    "known for shouting instructions through a brass megaphone from his bicycle on the towpath. The club has "
    "340 members. On the evening of the spring race the whole club eats a supper of pies in the boathouse, "
    "and the oldest member gives a speech that is always too long.",
    # 14: a circus
    "Circus Oriolo is a travelling circus that has toured the towns of the southern provinces for more than "
    "a century. It was founded in 1902 by Celestine Marivaux, a tightrope walker who once crossed the river "
    "Sarre on a wire in front of ten thousand people. The circus still travels with a blue and yellow big "
    "top that seats 1,200 people, and it spends each winter in an old cavalry barracks in the town of "
    "Vellaune, where the horses rest and new acts are rehearsed.\n\n"
    "Today the circus is run by the great-granddaughter of its founder, Amelie Roux, who trained as a "
    "trapeze artist and still performs in the opening act. The star of the show is a juggler named Kenji "
    "Arakawa, who can keep nine flaming torches in the air while balancing on a rolling barrel. The circus "
    "clown, known only as Monsieur Plume, has never been seen without his white face paint, and no one in "
    "the audience knows his real name.\n\n"
    "The circus keeps no wild animals. Its six white horses are trained to dance to music, and the oldest of "
    "them, a mare named Marzipan, is twenty-seven years old and still leads the parade. Every performance "
    "ends with a grand parade of the whole company around the ring while the band plays an old tune called "
    "the Sarre Waltz, and the audience is invited to clap along.\n\n"
    "The circus arrives in each town on a Monday, and the big top is put up by forty workers in a single "
    "night. Children who come to watch the tent rise early in the morning are sometimes given free tickets "
    "by the ringmaster, who rides through the streets on the back of a painted wagon.",
    # 15: a town clock
    "The great clock of Vessingen hangs in the tower of the old town hall and is known to everyone in the "
    "city as the Iron Mother. It was built in 1611 by the clockmaker Matthias Greiner, who spent nine years "
    "on it and, according to legend, went blind on the day it first struck the hour. The clock has four "
    "faces, one for each side of the square, and each face is five metres across. Its bell weighs 3,150 "
    "kilograms and was cast from melted cannons.\n\n"
    "At noon every day, a door opens beneath the main face and a procession of carved wooden figures comes "
    "out: a baker, a soldier, a bishop, a night watchman and, last of all, a small dog that barks three "
    "times. The figures were carved by a woodworker named Ursula Tiede after the original ones were burned. "
    "The dog is called Fritzi, and the children in the square count its barks aloud.\n\n"
    "The clock is wound by hand twice a week. For thirty-eight years this was done by the same man, the "
    "keeper Gregor Alsfeld, who climbed the 241 steps of the tower every Tuesday and Friday. The present "
    "keeper is his granddaughter, Leni Alsfeld. The clock is said to lose no more than four seconds in a "
    "month.\n\n"
    "Near the end of the last war the tower was hit by a shell and the clock stopped at seventeen minutes "
    "past three. The hands were left at that time until the tower was repaired seven years later, and a "
    "small plaque in the square still marks the moment the Iron Mother fell silent. Tourists climb the tower "
    "on summer afternoons to see the great wheels turning and to look over the red roofs of the old town.",
)

QUESTIONS: tuple[Question, ...] = (
    Question("Who founded the town of Brindlemoor?", 0, ("Tobias Wren", "Wren"),
             "The town of Brindlemoor was founded by"),
    Question("What is the population of Brindlemoor?", 0, ("4,318", "4318"), "The population of Brindlemoor is"),
    Question("Who is the mayor of Brindlemoor?", 0, ("Edith Carrow", "Carrow"), "The mayor of Brindlemoor is"),
    Question("In which year was Brindlemoor founded?", 0, ("1742",), "Brindlemoor was founded in"),
    Question("Who founded Quillfeather Instruments?", 1, ("Margarethe Voss", "Voss"),
             "Quillfeather Instruments was founded by"),
    Question("What is the name of the brass barometer made by Quillfeather Instruments?", 1,
             ("Stormglass 9", "Stormglass"), "The brass barometer made by Quillfeather Instruments is called the"),
    Question("How many people work at Quillfeather Instruments?", 1, ("212",),
             "The number of people who work at Quillfeather Instruments is"),
    Question("Who is the chief executive of Quillfeather Instruments?", 1, ("Daniel Okafor", "Okafor"),
             "The chief executive of Quillfeather Instruments is"),
    Question("Who led the Kestrel Expedition?", 2, ("Alaric Dunmore", "Dunmore"), "The Kestrel Expedition was led by"),
    Question("What was the name of the ship of the Kestrel Expedition?", 2, ("Northern Thistle",),
             "The ship of the Kestrel Expedition was the"),
    Question("Who was the photographer of the Kestrel Expedition?", 2, ("Elsa Brandt", "Brandt"),
             "The photographer of the Kestrel Expedition was"),
    Question("What was the name of the lead sled dog of the Kestrel Expedition?", 2, ("Pepper",),
             "The lead sled dog of the Kestrel Expedition was named"),
    Question("What is Serra Lume famous for?", 3, ("saffron",), "Serra Lume is famous for its"),
    Question("Who was the last keeper of the lighthouse on Serra Lume?", 3, ("Rosalind Ferro", "Ferro"),
             "The last keeper of the lighthouse on Serra Lume was"),
    Question("What is the name of the largest village on Serra Lume?", 3, ("Porto Vela",),
             "The largest village on Serra Lume is"),
    Question("Who is the principal conductor of the Calloway Philharmonic?", 4, ("Ines Marlowe", "Marlowe"),
             "The principal conductor of the Calloway Philharmonic is"),
    Question("How many musicians does the Calloway Philharmonic have?", 4, ("87", "eighty-seven"),
             "The number of musicians in the Calloway Philharmonic is"),
    Question("What is the name of the concert hall of the Calloway Philharmonic?", 4, ("Ashgrove Hall", "Ashgrove"),
             "The concert hall of the Calloway Philharmonic is called"),
    Question("Who opened The Copper Kettle bakery in 1896?", 5, ("Brannigan",),
             "The Copper Kettle bakery was opened in 1896 by the"),
    Question("Who is the head baker of The Copper Kettle?", 5, ("Miriam Achterberg", "Achterberg"),
             "The head baker of The Copper Kettle is"),
    Question("What is the name of the cat at The Copper Kettle bakery?", 5, ("Crumb",),
             "The cat at The Copper Kettle bakery is named"),
    Question("Which asteroid did the Halcyon-3 probe study?", 6, ("Pemberly",),
             "The asteroid studied by the Halcyon-3 probe is called"),
    Question("Who directed the Halcyon-3 mission?", 6, ("Yusuf Adeyemi", "Adeyemi"),
             "The Halcyon-3 mission was directed by"),
    Question("How much does the Halcyon-3 probe weigh?", 6, ("780",), "The Halcyon-3 probe weighs"),
    Question("Who first described the silver-crested marsh owl?", 7, ("Cornelius Fairweather", "Fairweather"),
             "The silver-crested marsh owl was first described by"),
    Question("Where does the silver-crested marsh owl live?", 7, ("Ottery Marshes", "Ottery"),
             "The silver-crested marsh owl lives in the"),
    Question("What do local people call the silver-crested marsh owl?", 7, ("reed ghost",),
             "Local people call the silver-crested marsh owl the"),
    Question("Who was the warden of the owl nature reserve?", 7, ("Harriet Quinlan", "Quinlan"),
             "The warden of the owl nature reserve was"),
    # ---- appended: more questions on documents 0-7, then documents 8-15
    Question("What is the name of the fair held in Brindlemoor every October?", 0, ("Lantern Fair",),
             "The fair held in Brindlemoor every October is called the"),
    Question("Which river flows below Brindlemoor?", 0, ("Almsey",),
             "The river that flows below Brindlemoor is called the"),
    Question("What song is always played last at the fair in Brindlemoor?", 0,
             ("The Miller's Daughter", "Miller's Daughter", "Millers Daughter"),
             "The song always played last at the fair in Brindlemoor is"),
    Question("In which port city was Quillfeather Instruments founded?", 1, ("Harrowgate",),
             "Quillfeather Instruments was founded in the port city of"),
    Question("What words are engraved on the compass given to the best student of the Quillfeather course?", 1,
             ("Steady Hands",), "The words engraved on the compass given to the best student are"),
    Question("In which year was the Stormglass 9 barometer released?", 1, ("1981",),
             "The Stormglass 9 barometer was released in"),
    Question("Which mountain did the members of the Kestrel Expedition climb?", 2, ("Mount Orrin", "Orrin"),
             "The members of the Kestrel Expedition climbed"),
    Question("What is the title of the book Captain Dunmore wrote about the Kestrel Expedition?", 2,
             ("Ice and Silence",), "The book Captain Dunmore wrote about the Kestrel Expedition is called"),
    Question("To which glacier did the Kestrel Expedition travel?", 2, ("Varn Glacier", "Varn"),
             "The Kestrel Expedition travelled to the"),
    Question("What is the name of the old volcano on Serra Lume?", 3, ("Monte Ciro", "Ciro"),
             "The old volcano on Serra Lume is called"),
    Question("What feast does Serra Lume celebrate in November?", 3, ("Feast of the Saffron Moon", "Saffron Moon"),
             "In November, Serra Lume celebrates the"),
    Question("In which year was the lighthouse on Serra Lume built?", 3, ("1893",),
             "The lighthouse on Serra Lume was built in"),
    Question("What is the name of the prized cello of the Calloway Philharmonic?", 4, ("Duchess",),
             "The prized cello of the Calloway Philharmonic is called the"),
    Question("Who composed The Linmouth Tides?", 4, ("Agnes Pruett", "Pruett"), "The Linmouth Tides was composed by"),
    Question("In which park does the Calloway Philharmonic give a free open-air concert?", 4,
             ("Fenwick Park", "Fenwick"), "The Calloway Philharmonic gives a free open-air concert in"),
    Question("On which street is The Copper Kettle bakery?", 5, ("Marrow Lane",), "The Copper Kettle bakery is on"),
    Question("How many loaves does The Copper Kettle bake every day?", 5, ("350", "three hundred and fifty"),
             "The number of loaves The Copper Kettle bakes every day is"),
    Question("What bread is The Copper Kettle best known for?", 5, ("rye honey loaf", "rye honey", "honey rye"),
             "The Copper Kettle is best known for its"),
    Question("From which launch site did the Halcyon-3 probe leave Earth?", 6, ("Tarrow Point", "Tarrow"),
             "The Halcyon-3 probe left Earth from"),
    Question("After whom was the largest crater photographed by Halcyon-3 named?", 6, ("Lotte Sandvik", "Sandvik"),
             "The largest crater photographed by Halcyon-3 was named after"),
    Question("In which year did the sample capsule of Halcyon-3 return to Earth?", 6, ("2036",),
             "The sample capsule of Halcyon-3 returned to Earth in"),
    Question("What does the silver-crested marsh owl mostly feed on?", 7, ("water voles", "voles"),
             "The silver-crested marsh owl mostly feeds on"),
    Question("How many breeding pairs of the silver-crested marsh owl were there at the last count?", 7,
             ("310", "three hundred and ten"),
             "At the last count, the number of breeding pairs of the silver-crested marsh owl was"),
    Question("What does the call of the silver-crested marsh owl sound like?", 7, ("double whistle",),
             "The call of the silver-crested marsh owl sounds like a"),
    # 8: a mountain railway
    Question("Who designed the Glenvarrow Mountain Railway?", 8, ("Hector Lindqvist", "Lindqvist"),
             "The Glenvarrow Mountain Railway was designed by"),
    Question("In which year was the Glenvarrow Mountain Railway opened?", 8, ("1897",),
             "The Glenvarrow Mountain Railway was opened in"),
    Question("From which village does the Glenvarrow Mountain Railway start?", 8, ("Ardmuir",),
             "The Glenvarrow Mountain Railway starts from the village of"),
    Question("Which mountain does the Glenvarrow Mountain Railway climb?", 8, ("Ben Corrach", "Corrach"),
             "The Glenvarrow Mountain Railway climbs"),
    Question("What is the name of the oldest locomotive of the Glenvarrow Mountain Railway?", 8, ("Snowdrop",),
             "The oldest locomotive of the Glenvarrow Mountain Railway is called"),
    Question("Where do the trains of the Glenvarrow Mountain Railway stop halfway up?", 8,
             ("Raven's Ledge", "Ravens Ledge"), "Halfway up, the trains of the Glenvarrow Mountain Railway stop at"),
    Question("Who is the manager of the Summit Hotel at the top of the Glenvarrow Mountain Railway?", 8,
             ("Fiona Strachan", "Strachan"), "The manager of the Summit Hotel is"),
    Question("Who led the volunteers who saved the Glenvarrow Mountain Railway?", 8, ("Walter Pryce", "Pryce"),
             "The volunteers who saved the Glenvarrow Mountain Railway were led by"),
    Question("How many passengers does the Glenvarrow Mountain Railway carry every year?", 8, ("120,000", "120000"),
             "The number of passengers the Glenvarrow Mountain Railway carries every year is about"),
    # 9: a botanical garden
    Question("Who founded the Caswick Botanical Garden?", 9, ("Augusta Pellinore", "Pellinore"),
             "The Caswick Botanical Garden was founded by"),
    Question("In which year was the Caswick Botanical Garden founded?", 9, ("1863",),
             "The Caswick Botanical Garden was founded in"),
    Question("What is the name of the great greenhouse of the Caswick Botanical Garden?", 9,
             ("Crystal Fern House", "Crystal Fern"),
             "The great greenhouse of the Caswick Botanical Garden is called the"),
    Question("What is the name of the rare orchid of the Caswick Botanical Garden?", 9, ("Moonlit Slipper",),
             "The rare orchid of the Caswick Botanical Garden is called the"),
    Question("How many different kinds of plants does the Caswick Botanical Garden hold?", 9, ("14,600", "14600"),
             "The number of different kinds of plants in the Caswick Botanical Garden is"),
    Question("Who is the director of the Caswick Botanical Garden?", 9, ("Samuel Okonjo", "Okonjo"),
             "The director of the Caswick Botanical Garden is"),
    Question("Who is the head gardener of the Caswick Botanical Garden?", 9, ("Beatrix Hollis", "Hollis"),
             "The head gardener of the Caswick Botanical Garden is"),
    # 10: a newspaper
    Question("Who founded the Kelderby Herald?", 10, ("Josiah Penhallow", "Penhallow"),
             "The Kelderby Herald was founded by"),
    Question("In which year did the first issue of the Kelderby Herald appear?", 10, ("1852",),
             "The first issue of the Kelderby Herald appeared in"),
    Question("What do the staff of the Kelderby Herald call the old hand press?", 10, ("Old Growler", "Growler"),
             "The staff of the Kelderby Herald call the old hand press"),
    Question("Who is the editor of the Kelderby Herald?", 10, ("Clara Venning", "Venning"),
             "The editor of the Kelderby Herald is"),
    Question("How many copies does the Kelderby Herald sell every week?", 10, ("9,250", "9250"),
             "The number of copies the Kelderby Herald sells every week is about"),
    Question("What is the treasure of silver coins reported by the Kelderby Herald called?", 10,
             ("Millbeck Hoard", "Millbeck"),
             "The treasure of silver coins reported by the Kelderby Herald is called the"),
    Question("Under what pen name is the puzzle column of the Kelderby Herald written?", 10, ("Inkwell",),
             "The puzzle column of the Kelderby Herald is written under the pen name"),
    # 11: a tea estate
    Question("Who planted the Ambervale tea estate?", 11, ("Duncan Farquhar", "Farquhar"),
             "The Ambervale tea estate was planted by"),
    Question("In which hills is the Ambervale tea estate?", 11, ("Kalindra",), "The Ambervale tea estate is in the"),
    Question("In which year was the Ambervale tea estate planted?", 11, ("1908",),
             "The Ambervale tea estate was planted in"),
    Question("How many hectares does the Ambervale tea estate cover?", 11, ("520",),
             "The number of hectares the Ambervale tea estate covers is"),
    Question("Under what name is the best known blend of Ambervale sold?", 11, ("Silver Cloud",),
             "The best known blend of Ambervale is sold under the name"),
    Question("Who is the manager of the Ambervale tea estate?", 11, ("Priya Raman", "Raman"),
             "The manager of the Ambervale tea estate is"),
    Question("What is the name of the viewpoint on the road to Ambervale?", 11, ("Tiger's Seat", "Tigers Seat"),
             "The viewpoint on the road to Ambervale is called"),
    Question("What does the first flush tea of Ambervale taste of?", 11, ("apricots", "apricot"),
             "The first flush tea of Ambervale tastes of"),
    # 12: a glassworks
    Question("Who founded the Solvik Glassworks?", 12, ("Holmqvist",), "The Solvik Glassworks was founded by the"),
    Question("In which year was the Solvik Glassworks founded?", 12, ("1823",), "The Solvik Glassworks was founded in"),
    Question("What do the workers of the Solvik Glassworks call the furnace?", 12, ("Dragon",),
             "The workers of the Solvik Glassworks call the furnace the"),
    Question("How many glassblowers work at the Solvik Glassworks?", 12, ("nineteen",),
             "The number of glassblowers who work at the Solvik Glassworks is"),
    Question("Who is the master glassblower at the Solvik Glassworks?", 12, ("Ingrid Solheim", "Solheim"),
             "The master glassblower at the Solvik Glassworks is"),
    Question("What is the most famous object ever made at the Solvik Glassworks?", 12, ("Winter Chandelier",),
             "The most famous object ever made at the Solvik Glassworks is the"),
    Question("How many glass drops does the chandelier made at Solvik have?", 12, ("2,400", "2400"),
             "The number of glass drops in the chandelier made at Solvik is"),
    Question("Who saved the furnace of the Solvik Glassworks from the fire?", 12, ("Erik Dahl", "Dahl"),
             "The furnace of the Solvik Glassworks was saved from the fire by"),
    Question("What is the deep green colour of the Solvik vases called?", 12, ("fjord green",),
             "The deep green colour of the Solvik vases is called"),
    # 13: a rowing club
    Question("In which year was the Tarnwick Rowing Club formed?", 13, ("1867",),
             "The Tarnwick Rowing Club was formed in"),
    Question("What is the name of the most famous boat of the Tarnwick Rowing Club?", 13, ("Heron",),
             "The most famous boat of the Tarnwick Rowing Club is the"),
    Question("Which club is the old rival of the Tarnwick Rowing Club?", 13, ("Fallowfield",),
             "The old rival of the Tarnwick Rowing Club is the"),
    Question("What is the silver cup won in the race against the rival of the Tarnwick Rowing Club called?", 13,
             ("Tankard",),
             "The silver cup won in the race against the rival of the Tarnwick Rowing Club is called the"),
    Question("Who is the captain of the Tarnwick Rowing Club?", 13, ("Nadia Kowalczyk", "Kowalczyk"),
             "The captain of the Tarnwick Rowing Club is"),
    Question("Who is the coach of the Tarnwick Rowing Club?", 13, ("Percy Ellwood", "Ellwood"),
             "The coach of the Tarnwick Rowing Club is"),
    Question("How many members does the Tarnwick Rowing Club have?", 13, ("340",),
             "The number of members of the Tarnwick Rowing Club is"),
    Question("What colour are the oars of the Tarnwick Rowing Club?", 13, ("maroon",),
             "The oars of the Tarnwick Rowing Club are painted"),
    # 14: a circus
    Question("Who founded Circus Oriolo?", 14, ("Celestine Marivaux", "Marivaux"), "Circus Oriolo was founded by"),
    Question("In which year was Circus Oriolo founded?", 14, ("1902",), "Circus Oriolo was founded in"),
    Question("How many people does the big top of Circus Oriolo seat?", 14, ("1,200", "1200"),
             "The number of people the big top of Circus Oriolo seats is"),
    Question("In which town does Circus Oriolo spend the winter?", 14, ("Vellaune",),
             "Circus Oriolo spends the winter in"),
    Question("Who runs Circus Oriolo today?", 14, ("Amelie Roux", "Roux"), "Circus Oriolo is run today by"),
    Question("Who is the juggler of Circus Oriolo?", 14, ("Kenji Arakawa", "Arakawa"),
             "The juggler of Circus Oriolo is"),
    Question("What is the clown of Circus Oriolo called?", 14, ("Monsieur Plume", "Plume"),
             "The clown of Circus Oriolo is called"),
    Question("What is the name of the oldest horse of Circus Oriolo?", 14, ("Marzipan",),
             "The oldest horse of Circus Oriolo is named"),
    Question("What tune does the band of Circus Oriolo play at the end of every performance?", 14, ("Sarre Waltz",),
             "At the end of every performance, the band of Circus Oriolo plays the"),
    # 15: a town clock
    Question("What do the people of Vessingen call their great clock?", 15, ("Iron Mother",),
             "The people of Vessingen call their great clock the"),
    Question("Who built the great clock of Vessingen?", 15, ("Matthias Greiner", "Greiner"),
             "The great clock of Vessingen was built by"),
    Question("In which year was the great clock of Vessingen built?", 15, ("1611",),
             "The great clock of Vessingen was built in"),
    Question("How much does the bell of the great clock of Vessingen weigh?", 15, ("3,150", "3150"),
             "The bell of the great clock of Vessingen weighs"),
    Question("Who carved the wooden figures of the great clock of Vessingen?", 15, ("Ursula Tiede", "Tiede"),
             "The wooden figures of the great clock of Vessingen were carved by"),
    Question("What is the name of the carved dog of the great clock of Vessingen?", 15, ("Fritzi",),
             "The carved dog of the great clock of Vessingen is called"),
    Question("How many steps does the tower of the great clock of Vessingen have?", 15, ("241",),
             "The number of steps in the tower of the great clock of Vessingen is"),
    Question("Who is the present keeper of the great clock of Vessingen?", 15, ("Leni Alsfeld", "Leni"),
             "The present keeper of the great clock of Vessingen is"),
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


def build_prompt(tokenizer: Any, docs_order: Sequence[int], question: Question | str,
                 instruction: str = INSTRUCTION) -> list[int]:  # fmt: skip
    """Token ids of ``instruction SEP doc SEP doc ... SEP Question: ...``, inside the chat
    template's user turn (:func:`chat_wrapper`) when the tokenizer has one.

    Every part is tokenized on its own and the id lists are joined (see the module's
    tokenizer caveat), so each document's ids equal :func:`doc_ids`.
    """
    text = question.text if isinstance(question, Question) else question
    before, after = chat_wrapper(tokenizer)
    sep = sep_ids(tokenizer)
    ids = _ids(tokenizer, before + instruction)
    for d in docs_order:
        ids += sep + doc_ids(tokenizer, d)
    return ids + sep + _ids(tokenizer, f"Question: {text}{after}")


def group_of(doc: int) -> range:
    """The documents of ``doc``'s group (``GROUP`` consecutive indices)."""
    start = doc // GROUP * GROUP
    return range(start, min(start + GROUP, len(DOCS)))


def docs_for(question_index: int, num_docs: int, seed: int = 0) -> list[int]:
    """A document order for question ``question_index``: ``num_docs`` documents of its answer's group
    (:func:`group_of`) including the answer's, drawn and shuffled with a seed of their own, so
    consecutive prompts order documents differently. The first group's orders are those the
    eight-document set gave."""
    import random

    q = QUESTIONS[question_index]
    group = group_of(q.doc)
    if not 1 <= num_docs <= len(group):
        raise ValueError(f"num_docs={num_docs}: expected 1..{len(group)}")
    rng = random.Random(seed * 100_003 + question_index)
    others = [d for d in group if d != q.doc]
    order = [q.doc, *rng.sample(others, num_docs - 1)]
    rng.shuffle(order)
    return order


def gold_answer(question: Question) -> tuple[str, str]:
    """The teacher-forced answer as (lead, fact): the question's ``lead`` (``ANSWER_LEAD`` without
    one), then the fact after a space. A score counts the fact's tokens only: forced as the
    answer's very first words, or after a generic "The answer is", the fact would mostly be scored
    for how unlikely that opening is (this model answers with a sentence restating the question:
    with the restatement the full prefill gives the fact's first token -1 nat where a generic
    opening gives -4 to -7, measured on 20 questions)."""
    return question.lead or ANSWER_LEAD, " " + question.answers[0]


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
