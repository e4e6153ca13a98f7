"""Named SQL queries, kept in ``.sql`` files next to this module."""

from functools import partial

from sinks.db import named_query

query = partial(named_query, __name__)
