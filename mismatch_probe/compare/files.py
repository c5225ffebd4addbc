"""The files `probe compare` writes beside compare.json, named once for the writer and the page."""

FIGURE = "extreme_fraction_compare.png"
