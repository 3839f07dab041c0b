"""Model families for the paged path: each architecture described by its parts over one decoder."""
