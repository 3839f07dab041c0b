"""Building blocks of the paged model code."""
