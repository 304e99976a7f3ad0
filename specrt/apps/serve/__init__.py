"""`specrt serve`: the scheduler (one request alone, several through the batched decoder) and the HTTP app."""
