"""Fragment metadata: the ledger/fragment model, placement, rollover and (later) retention.

The pure parts of this package (model, placement, rollover) import nothing but the standard
library; the metadata-store backends live in their own modules.
"""
