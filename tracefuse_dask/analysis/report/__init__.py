"""What a person reads: the HTML pages of an analysis and of a diff (``page``), and what is shown of the critical
path (``marks``: its trace marks and its one-line summary)."""
