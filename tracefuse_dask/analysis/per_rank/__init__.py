"""What a map task computes of one rank: its events decoded (``decode``), its call tree, breakdowns and tables
(``rank``), its collective calls, counters, op models, kernel sequences and collective_trace calls, and its
critical-path walks (``walker``). Pure functions of one rank; they import nothing of ``analysis`` but ``schema``."""
