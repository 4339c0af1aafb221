"""The event store: a job's events as Parquet parts, one per rank, that SQL answers over (``tracefuse index``,
``tracefuse sql``).

``schema.py`` holds the tables' columns and the views, with the schema's version (the manifest's name is here: the
command line tells a store by it before it imports Arrow);
``columns.py`` turns one rank's merged events into its tables; ``index.py`` runs the merge's plan and rank tasks to
write the parts and then the manifest; ``query.py`` reads a store and runs SQL over it with DuckDB; ``output.py``
writes a query's result.
"""

__all__ = ["MANIFEST"]

MANIFEST = "tracefuse-store.json"  # a folder that holds it is a store (``schema`` says what it lists)
