# placeholder: install rules (filled below)
