"""``python -m acceltrain``: the ``acceltrain`` command (also under ``accelerate launch -m acceltrain``)."""

from acceltrain.commands.cli import main

if __name__ == "__main__":
    main()
