"""Storage through fsspec, with no Dask: reading files (``files``), expanding inputs and resolving ranks
(``inputs``), writing outputs (``output``), and joining an output's pieces on S3, GCS or a local disk
(``joins``)."""
