"""Generation with live index lookups, and drafts read off exact matches."""
