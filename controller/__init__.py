"""laneway's controller: the ledger (every state write), admission policy and the daemon."""
