"""What the reduce computes across ranks: collectives matched, clock offsets and stragglers, the critical path
stitched across ranks and its cause, the what-if, efficiency, and the counters', op models' and sequences'
summaries. Pure functions of the ranks' tables; they import nothing of ``analysis`` but ``schema``."""
