"""S3 locations in one spelling: `s3://bucket/prefix`, parsed and rebuilt here only.

A checkpoint location is a prefix, never a bare bucket (every object under it counts as a
checkpoint, so a bare bucket would make the whole bucket look like checkpoints). The
canonical form has no trailing slash; `key_prefix` is the form S3 listings take (one
trailing slash), so `<prefix>/_preemptor/...` is built one way only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Bucket names: 3-63 characters, lower-case letters, digits, dots and hyphens, starting and
# ending with a letter or digit (S3 bucket naming rules).
_URI = re.compile(r"s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<key>.*))?")


@dataclass(frozen=True, slots=True)
class S3Uri:
    """A bucket and a key prefix without leading or trailing slashes ("" for the bucket)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str, *, require_prefix: bool = True) -> "S3Uri":
        """Parse `s3://bucket[/prefix]`; trailing slashes of the prefix are dropped.

        Raises:
            ValueError: not an `s3://` URI with a valid bucket name, or (with
                `require_prefix`) one without a prefix.
        """
        match = _URI.fullmatch(uri.strip()) if isinstance(uri, str) else None
        if match is None:
            raise ValueError(f"not an s3://bucket/prefix URI: {uri!r}")
        prefix = (match["key"] or "").strip("/")
        if require_prefix and not prefix:
            raise ValueError(f"an s3:// URI with a prefix is required, got {uri!r}")
        return cls(match["bucket"], prefix)

    @property
    def key_prefix(self) -> str:
        """The prefix as S3 listings take it: `a/b/` (or "" for the whole bucket)."""
        return f"{self.prefix}/" if self.prefix else ""

    def key(self, relative: str) -> str:
        """The key of `relative` under this prefix."""
        return self.key_prefix + relative.lstrip("/")

    def child(self, relative: str) -> "S3Uri":
        return S3Uri(self.bucket, self.key(relative).rstrip("/"))

    @property
    def location(self) -> str:
        """`bucket/a/b/`: the bucket and key prefix as one string (a table key)."""
        return f"{self.bucket}/{self.key_prefix}"

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def normalize(uri: str) -> str:
    """The canonical spelling of a checkpoint location (`s3://bucket/prefix`, no slash at the end)."""
    return str(S3Uri.parse(uri))
