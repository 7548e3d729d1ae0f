"""``nexus-sli publish``: an exported repository to S3-compatible object storage, as new version folders."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import http_url
from .interrupts import sigterm_as_interrupt


def add_parser(commands) -> None:
    publish = commands.add_parser(
        "publish", help="upload a model repository to s3://bucket/prefix as new version folders (docs/deployment.md)")
    publish.add_argument("--repository", default="model_repository", help="the exported repository to publish")
    publish.add_argument("--to", required=True, metavar="s3://bucket/prefix",
                         help="where servers read the repository (s3://HOST:PORT/bucket/prefix names the endpoint "
                              "as Triton does)")
    publish.add_argument("--endpoint-url", default=None, type=http_url,
                         help="the S3 endpoint of an S3-compatible store (MinIO, SeaweedFS, Ceph, ...); credentials "
                              "come from the standard AWS environment or ~/.aws, never from the command line")
    publish.add_argument("--dry-run", action="store_true",
                         help="list what would be uploaded, switched and deleted (with --prune, the folders it "
                              "deletes); write nothing")
    publish.add_argument("--prune", action="store_true",
                         help="after the switch, delete the version folders no config serves (servers copy every "
                              "version folder of a model when they load it); needs s3:DeleteObject")
    publish.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nexus_sli.exporter.triton.publish import Destination, plan_publish, publish

    destination = Destination.parse(args.to, args.endpoint_url)
    if args.dry_run:
        result = plan_publish(Path(args.repository), destination, prune=args.prune)
    else:
        with sigterm_as_interrupt():  # the lock is deleted as after a Ctrl-C: left, it would refuse every later one
            result = publish(Path(args.repository), destination, prune=args.prune)
    print(f"{'would publish' if args.dry_run else 'published'} {args.repository} -> {destination}")
    for line in result.describe():
        print(line)
    return 0
