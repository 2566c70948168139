"""The `acceltrain` command and its subcommands: bench, predict, merge, ray."""
