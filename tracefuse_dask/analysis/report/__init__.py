"""What a person reads: the HTML pages of an analysis (``analysis_page``) and of a diff (``diff_page``), drawn by
``page``, and what is shown of the critical path (``marks``: its trace marks and its one-line summary)."""
