"""Two processes around ``on_main_process_first``: the process named by ``--fail-rank`` raises in its
work (``--error config`` or ``os``); every process must leave with an error instead of waiting forever.
Each writes how it ended to ``<--report-dir>/rank<N>.txt`` (their stdout lines can interleave)."""

import argparse
from pathlib import Path

from accelerate import PartialState

from acceltrain.config.options import ConfigError
from acceltrain.runtime.distributed import on_main_process_first

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, required=True)
parser.add_argument("--error", choices=("config", "os"), required=True)
parser.add_argument("--report-dir", type=Path, required=True)
options = parser.parse_args()
state = PartialState(cpu=True)


def work():
    if state.process_index == options.fail_rank:
        raise ConfigError("--data-dir 'x' is broken") if options.error == "config" else OSError("disk full")
    return "ok"


report = options.report_dir / f"rank{state.process_index}.txt"
try:
    on_main_process_first(work)
except (ConfigError, RuntimeError, OSError) as err:
    report.write_text(f"rank {state.process_index}: {type(err).__name__}: {err}")
    raise SystemExit(2) from None
report.write_text(f"rank {state.process_index}: ok")
