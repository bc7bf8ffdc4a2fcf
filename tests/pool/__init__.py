"""The pool: the policy that follows the trainer, elastic runs."""
