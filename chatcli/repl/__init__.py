"""The interactive front end: loop, slash commands, keys, rendering."""
