"""Two processes around ``on_main_process_first``: the process named by ``--fail-rank`` raises in its
work (``--error config`` or ``os``); every process must leave with an error instead of waiting forever."""

import argparse

from accelerate import PartialState

from acceltrain.config import ConfigError
from acceltrain.distributed import on_main_process_first

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, required=True)
parser.add_argument("--error", choices=("config", "os"), required=True)
options = parser.parse_args()
state = PartialState(cpu=True)


def work():
    if state.process_index == options.fail_rank:
        raise ConfigError("--data-dir 'x' is broken") if options.error == "config" else OSError("disk full")
    return "ok"


try:
    on_main_process_first(work)
except (ConfigError, RuntimeError, OSError) as err:
    print(f"rank {state.process_index}: {type(err).__name__}: {err}", flush=True)
    raise SystemExit(2) from None
print(f"rank {state.process_index}: ok", flush=True)
