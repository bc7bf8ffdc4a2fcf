"""Applications on top of the library, which never imports them: the ``raypipe``
command, job submission, converting an image folder to shards, the demo job and data.
"""

from raypipe.cli.app import main

__all__ = ["main"]
