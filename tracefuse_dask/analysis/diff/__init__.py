"""``tracefuse diff``: two analyses compared (``compare``). Pure functions; no IO, no Dask."""
