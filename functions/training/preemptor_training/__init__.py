"""The training side of Preemptor's checkpoint protocol, for training scripts.

Standard library only; boto3 is imported when a checkpoint location is an `s3://` URI.
The contract (directory layout, manifest, request marker, signals) is in docs/training.md.
"""

from .checkpointer import Action, Checkpointer, RestoreFailed, Stopped
from .environment import ENV_GRACE, ENV_POLL, ENV_S3_URI, SAGEMAKER_CHECKPOINT_DIR, Platform
from .manifest import MANIFEST, REQUEST_FILE, FileEntry, Manifest, ManifestError, Reason
from .marker import CheckpointRequest, MalformedRequest, parse_request
from .s3 import S3Error, S3Location
from .store import LocalStore, ReservedName

__all__ = [
    "Action",
    "CheckpointRequest",
    "Checkpointer",
    "ENV_GRACE",
    "ENV_POLL",
    "ENV_S3_URI",
    "FileEntry",
    "LocalStore",
    "MANIFEST",
    "MalformedRequest",
    "Manifest",
    "ManifestError",
    "Platform",
    "REQUEST_FILE",
    "Reason",
    "RestoreFailed",
    "ReservedName",
    "S3Error",
    "S3Location",
    "SAGEMAKER_CHECKPOINT_DIR",
    "Stopped",
    "parse_request",
]
