"""`python -m tools.cli` runs the `llama32` command line."""
from tools.cli import main

main()
