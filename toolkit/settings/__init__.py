"""The settings of a run, the lowest room: the argument dataclasses, each setting checked where it is declared
(arguments.py), the layered parser that fills them from a recipe and its overrides (parser.py), and the tasks a
recipe can name with the model classes each loads (tasks.py). Imports nothing of the toolkit but errors and
project: everything else reads its settings from here."""
