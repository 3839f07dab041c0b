"""Model families for the paged path: each architecture described by its structure over one decoder."""
