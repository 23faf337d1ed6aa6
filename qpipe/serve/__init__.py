"""serve."""

# The on-disk format of the `qpipe` build target (artifact.py). It lives here, away from torch, so
# the build stage can key on it while `qpipe plan` stays fast.
ARTIFACT_FORMAT_VERSION = 1
