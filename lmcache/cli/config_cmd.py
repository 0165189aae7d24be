"""``lmcache config check [FILE]``: validate a config exactly as the engine loads it."""

from __future__ import annotations

import argparse
import os
import sys

import yaml

EXIT_CONFIG_ERROR = 2


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="configuration tools", description="Configuration tools.")
    csub = p.add_subparsers(dest="config_cmd", metavar="COMMAND", required=True)
    check = csub.add_parser(
        "check",
        help="validate a YAML file plus LMCACHE_* env vars and print the effective config",
        description=(
            "Validate the YAML file FILE (default: $LMCACHE_CONFIG_FILE) plus the LMCACHE_* environment "
            "variables exactly as the engine loads them, and print the effective configuration (secrets "
            "masked). Exit 0 if valid, 2 with the file or variable, key, value and expectation if not."
        ),
    )
    check.add_argument("file", nargs="?", help="YAML file (default: $LMCACHE_CONFIG_FILE; none: env vars only)")
    check.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    from lmcache.observability.logs import effective_config
    from lmcache.v1.config import CONFIG_FILE_ENV, ConfigError, LMCacheEngineConfig, load_ec_engine_config

    path = args.file or os.environ.get(CONFIG_FILE_ENV) or None
    saved = os.environ.get(CONFIG_FILE_ENV)
    try:
        config = LMCacheEngineConfig.load(path)
        if path is not None:
            os.environ[CONFIG_FILE_ENV] = path  # the encoder-cache overrides are read from the same file
        load_ec_engine_config(config)
    except ConfigError as exc:
        print(f"lmcache: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    finally:  # main() may run inside another program (tests): leave its environment as it was
        if saved is None:
            os.environ.pop(CONFIG_FILE_ENV, None)
        else:
            os.environ[CONFIG_FILE_ENV] = saved
    source = path or "(no file: defaults + environment)"
    print(f"# lmcache effective configuration from {source} and LMCACHE_* environment variables")
    print(yaml.safe_dump(effective_config(config), sort_keys=True, default_flow_style=False), end="")
    print("# OK", file=sys.stderr)
    return 0
