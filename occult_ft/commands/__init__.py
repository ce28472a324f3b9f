"""Subcommands of the `occult-ft` console script: one module each, `add_parser(subparsers)` + `run(args)`."""
