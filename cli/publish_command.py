"""``nexus-sli publish``: an exported repository to S3-compatible object storage, as new version folders."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands) -> None:
    publish = commands.add_parser(
        "publish", help="upload a model repository to s3://bucket/prefix as new version folders (docs/deployment.md)")
    publish.add_argument("--repository", default="model_repository", help="the exported repository to publish")
    publish.add_argument("--to", required=True, metavar="s3://bucket/prefix",
                         help="where servers read the repository (s3://HOST:PORT/bucket/prefix names the endpoint "
                              "as Triton does)")
    publish.add_argument("--endpoint-url", default=None,
                         help="the S3 endpoint of an S3-compatible store (MinIO, SeaweedFS, Ceph, ...); credentials "
                              "come from the standard AWS environment or ~/.aws, never from the command line")
    publish.add_argument("--dry-run", action="store_true", help="list what would be uploaded and switched; write nothing")
    publish.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nexus_sli.exporter.triton.publish import Destination, plan, publish

    destination = Destination.parse(args.to, args.endpoint_url)
    result = (plan if args.dry_run else publish)(Path(args.repository), destination)
    print(f"{'would publish' if args.dry_run else 'published'} {args.repository} -> {destination}")
    for line in result.describe():
        print(line)
    return 0
