"""The toolkit's messages go through Python's ``logging``, under the ``acceltrain`` logger, the way the
Hugging Face libraries do theirs: silence them with ``--log-level warning``, redirect them with your own
handler (``logging.getLogger("acceltrain").addHandler(...)``), or drop the default one
(``removeHandler(acceltrain.runtime.logs.CONSOLE)``).

Importing ``acceltrain`` gives that logger its console handler at info (as transformers installs its own
handler), so the lines show in a notebook or script that never calls ``run_recipe`` or ``fit``; like
transformers', it does not propagate to the root logger, so a ``logging.basicConfig`` in your script does
not print every line twice. The handler writes each line to the current ``sys.stdout`` through
``tqdm.write``, so a live progress bar is redrawn below it instead of being cut in two.

The lines look as they did when they were printed: the message alone (``warning: `` before a warning);
the one-line ``error: ...`` of a failed run is not a log record and shows at every level. At
``--log-level debug`` each line carries time, level and logger name (accelerate's examples' format), so
that the toolkit's lines can be told apart from the libraries' debug output they are then mixed with.

Modules log through ``accelerate.logging.get_logger(__name__)`` (main process only unless
``main_process_only=False``), which needs Accelerate's state; code that runs before the state exists uses
``logging.getLogger(__name__)`` and checks the rank itself.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings

ROOT = "acceltrain"
# The libraries under the loop. In a normal run they warn about things the run cannot act on (DeepSpeed,
# once installed: "Setting accelerator to CPU ..." in every CPU run): errors only, unless --log-level debug.
LIBRARY_LOGGERS = ("DeepSpeed", "accelerate", "transformers", "datasets", "huggingface_hub")
DEBUG_FORMAT = logging.Formatter("%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S")
# what accelerate's logger puts before every message; the plain lines drop it on the main process
MAIN_PROCESS_PREFIX = "[RANK 0] "


class PlainFormatter(logging.Formatter):
    """The message as the toolkit printed it before it logged: ``warning: `` (``error: ``) before a warning
    (an error), and no ``[RANK 0]`` before the main process's lines."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage().removeprefix(MAIN_PROCESS_PREFIX)
        return message if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {message}"


class ConsoleHandler(logging.Handler):
    """Each record on the current ``sys.stdout`` (so ``contextlib.redirect_stdout`` and pytest's capture see
    it), through ``tqdm.write``, which clears live bars, writes the line, and redraws them."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm.auto import tqdm

            tqdm.write(self.format(record), file=sys.stdout)
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging's own policy: report on stderr, never fail the caller
            self.handleError(record)


PLAIN_FORMAT = PlainFormatter()
CONSOLE = ConsoleHandler()
CONSOLE.setFormatter(PLAIN_FORMAT)


def show_progress(asked: bool | None) -> bool:
    """Whether progress bars draw: ``--progress`` (True) always, ``--no-progress`` (False) never, unset only
    when stderr is a terminal (in a log file, a bar is thousands of carriage-return updates)."""
    if asked is not None:
        return asked
    return sys.stderr is not None and sys.stderr.isatty()


def install_console_handler() -> None:
    """The ``acceltrain`` logger's default set-up, done when ``acceltrain`` is imported: info and up, on the console."""
    toolkit = logging.getLogger(ROOT)
    if CONSOLE not in toolkit.handlers:
        toolkit.addHandler(CONSOLE)
        toolkit.setLevel(logging.INFO)
        toolkit.propagate = False


def set_log_level(level: str) -> None:
    """``--log-level``: the toolkit's messages from ``level`` up, and the libraries' loggers at errors only,
    or at their own defaults with ``debug``. ``run_recipe`` calls it as soon as the flags are parsed, before
    the recipe imports the libraries; ``fit()`` again, for code that calls it directly and because
    transformers, datasets and huggingface_hub set their logger's level once, when imported."""
    debug = level == "debug"
    logging.getLogger(ROOT).setLevel(level.upper())
    CONSOLE.setLevel(level.upper())  # also when ACCELERATE_LOG_LEVEL gave a module's logger a level of its own
    CONSOLE.setFormatter(DEBUG_FORMAT if debug else PLAIN_FORMAT)
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if debug else logging.ERROR)
    # DeepSpeed sets its logger's level when it is imported, typically mid-run (after both calls): its records are
    # filtered
    deepspeed = logging.getLogger("DeepSpeed")
    if debug:
        deepspeed.removeFilter(_errors_only)
    else:
        deepspeed.addFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


# What loading a pretrained model prints that the toolkit says itself, in a line (the weights a checkpoint lacks,
# those of another shape): transformers' LOAD REPORT table, and the FutureWarning peft triggers by reading
# transformers' deprecated ``is_gradient_checkpointing``.
LOAD_REPORT = "LOAD REPORT"
GRADIENT_CHECKPOINTING_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"


def _not_a_load_report(record: logging.LogRecord) -> bool:
    return LOAD_REPORT not in record.getMessage() or logging.getLogger(ROOT).isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def quiet_model_loading():
    """Load a pretrained model inside: transformers' LOAD REPORT table and peft's deprecation FutureWarning stay out
    (both shown at ``--log-level debug``); every other warning and log record comes through. A filter, not a level:
    transformers sets its logger's level when it is first imported, which a recipe does after ``--log-level``."""
    modeling = logging.getLogger("transformers.modeling_utils")
    modeling.addFilter(_not_a_load_report)
    try:
        with warnings.catch_warnings():
            if not logging.getLogger(ROOT).isEnabledFor(logging.DEBUG):
                warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING_DEPRECATION, category=FutureWarning)
            yield
    finally:
        modeling.removeFilter(_not_a_load_report)


def start_block(runtime: dict, cfg, checkpoints: str) -> list[str]:
    """The start-up lines every run prints: what data, which model, which engine, how many steps, which
    checkpoints are kept, where the outputs go. The whole config is in the run folder (train_config.yaml) and at
    ``--log-level debug``."""
    rows = [f"{runtime['train_rows']:,} training rows" if runtime.get("train_rows") is not None else "a stream"]
    if runtime.get("eval_rows") is not None:
        rows.append(f"{runtime['eval_rows']:,} eval rows")
    if runtime.get("classes"):
        rows.append(f"{runtime['classes']} classes")
    processes = runtime["num_processes"]
    held = runtime.get("parameters_per_process", runtime["parameters"])
    per_process = f", {held:,} held by each process" if held != runtime["parameters"] else ""
    engine = runtime["engine"]  # the one-process engine's name says it all; the others, how many processes
    if engine != "one process":
        engine += f", {processes} process{'es' if processes > 1 else ''}"
    epoch = f" ({runtime['steps_per_epoch']:,} an epoch)" if runtime.get("steps_per_epoch") else ""
    device = runtime["device"]
    if runtime["device_name"] not in (device, device.split(":")[0]):
        device = f"{runtime['device_name']} ({device})"
    return [
        f"data: {', '.join(rows)}",
        f"model: {runtime['model']}, {runtime['parameters']:,} parameters{per_process}",
        f"engine: {engine} on {device}, mixed precision {cfg.mixed_precision}",
        f"steps: {runtime['total_steps']:,}{epoch}, {runtime['global_batch_size']:,} samples a step "
        f"(--batch-size {cfg.batch_size} x {processes} process{'es' if processes > 1 else ''} x --grad-accum "
        f"{cfg.grad_accum})",
        f"checkpoints: {checkpoints}",
        f"outputs: {cfg.output_dir} (the whole config: train_config.yaml there, or --log-level debug)",
    ]


def log_on_main_process(name: str, message: str) -> None:
    """``message`` at info from the logger ``name``, on the main process only: also before Accelerate's state exists
    (applying LoRA, loading a folder), where the launcher's RANK says which process this is."""
    import os

    if os.environ.get("RANK", "0") == "0":
        logging.getLogger(name).info(message)
