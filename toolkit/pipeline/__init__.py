"""The run pipeline: a recipe's arguments -> data -> model -> trainer -> train, evaluate, save (runner.py)."""
