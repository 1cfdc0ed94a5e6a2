"""Worker processes: consume request topics, batch, run models, publish replies, commit."""
