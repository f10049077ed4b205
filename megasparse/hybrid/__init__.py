"""W = A B + S: native low-rank factors plus a sparse residual (issue 30)."""
