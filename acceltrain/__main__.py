"""``python -m acceltrain``: the ``acceltrain`` command (also under ``accelerate launch -m acceltrain``)."""

from acceltrain.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())  # the command's exit code (a sweep's 75 or 2), not always 0
