"""HTTP side: the Connexion app and one thin handler module per API dialect."""
