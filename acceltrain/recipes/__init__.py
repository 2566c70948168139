"""The recipes shipped with acceltrain, runnable wherever the package is installed:

    acceltrain-resnet-cifar --config smoke_cpu                   # console script; a preset by name
    python -m acceltrain.recipes.resnet_cifar --help
    accelerate launch -m acceltrain.recipes.causal_lm --config lm_tiny_cpu --text-files corpus.txt

Each is a config class, a ``main(cfg)`` and ``cli()``; copy one to start your own. The presets they name
are the YAML files in ``configs/`` (``--config NAME``; ``acceltrain.config.train_config.PRESETS``). In a checkout,
``recipes/*.py`` run these same recipes and ``recipes/configs`` is this folder."""
