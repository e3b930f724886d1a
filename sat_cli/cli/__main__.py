"""``python -m sat_cli.cli``: the `sat` command line (:func:`sat_cli.cli.main`)."""

from sat_cli.cli import main

main()
