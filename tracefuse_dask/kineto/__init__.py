"""The Kineto trace format, with no IO and no Dask: its vocabulary (``vocabulary``), exact times (``times``),
the merged trace's pid layout (``layout``), the reading of one rank's events (``events``), a file's bytes as a
document (``document``), its header without its events (``header``) and what its events show that a user should
know (``anomalies``)."""
