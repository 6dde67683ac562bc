"""`python -m forge_stream` is the `forge-stream` command."""

from forge_stream.cli import main

main()
