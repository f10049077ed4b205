"""Scaling studies: which method, size and token count for a budget of compute or memory."""
