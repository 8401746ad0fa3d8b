"""`python -m weightlift`: the same root command as the `weightlift` script."""

from weightlift.cli import main

main()
