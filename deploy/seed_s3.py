"""Upload example traces to an S3-compatible store, waiting for it to come up (used by docker-compose.yml).

python deploy/seed_s3.py LOCAL_DIR s3://bucket/prefix/ ENDPOINT_URL
"""
from __future__ import annotations

import sys
import time

import s3fs


def main(local: str, remote: str, endpoint: str) -> None:
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    bucket = remote.removeprefix("s3://").split("/", 1)[0]
    for _ in range(60):
        try:
            if not fs.exists(bucket):
                fs.mkdir(bucket)
            break
        except OSError:
            time.sleep(1)
    fs.put(local.rstrip("/") + "/", remote.rstrip("/") + "/", recursive=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
