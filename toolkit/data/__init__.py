"""The data room: where a model or data set comes from (sources.py: local, `package:` paths converted once by
packaged.py, the Hub, the configs stored in the repo), reading and checking a recipe's data (loading.py, with
formats.py, conversations.py and preference.py for what a row looks like), and preparing it for training:
tokenized, packed (packing.py), cached (preparation.py, whose `prepare_data` is the room's entry). The order
batches are drawn in is length_grouping.py's."""
