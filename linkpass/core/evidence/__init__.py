"""Evidence families for :mod:`linkpass.core.classify` (see :mod:`linkpass.core.evidence.builder`)."""
