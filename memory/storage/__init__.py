"""The database: connections, the single writer, migrations, and the SQL of every table."""
