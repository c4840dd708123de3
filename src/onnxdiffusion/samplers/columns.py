"""The sampler table's column layout (tables.py builds the rows; levels.py and the graphs read them)."""

COLUMNS = ("t", "c_in", "p", "q", "a", "c", "d", "e", "r", "k")
