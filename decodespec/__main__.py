"""`python -m decodespec` runs the command line."""

from .cli import main

main(prog_name="decodespec")
