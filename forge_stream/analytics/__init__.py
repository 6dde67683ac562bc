"""Analytics over the event history: curves and summaries read back from the topics."""
