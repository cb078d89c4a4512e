//! An export in a SQLite file: STRICT tables, JSON as text, times as
//! ISO-8601 text, build ids as UUID text. Written in one transaction with
//! prepared statements; a file this export created is removed again when
//! the export fails, so a failure leaves the target as it was.

use std::path::{Path, PathBuf};

use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{Connection, OpenFlags};

use super::schema::{RelTable, Ty, Value, META_TABLE, TABLES};
use super::{judge_origin, judge_target, Origin, Target};
use crate::model::{format_build_id, format_time, parse_build_id, parse_time};

fn sql_type(ty: Ty) -> &'static str {
    match ty {
        Ty::Text | Ty::Json | Ty::Time | Ty::Uuid => "TEXT",
        Ty::Bytes => "BLOB",
        Ty::Int | Ty::Bool => "INTEGER",
    }
}

fn create_table_sql(t: &RelTable) -> String {
    let mut parts: Vec<String> = t
        .columns
        .iter()
        .map(|c| {
            format!(
                "\"{}\" {}{}",
                c.name,
                sql_type(c.ty),
                if c.nullable { "" } else { " NOT NULL" }
            )
        })
        .collect();
    parts.push(format!("PRIMARY KEY ({})", quoted(t.primary_key)));
    for (column, parent) in t.references {
        parts.push(format!(
            "FOREIGN KEY (\"{column}\") REFERENCES \"{parent}\" (\"build_id\")"
        ));
    }
    format!(
        "CREATE TABLE \"{}\" (\n  {}\n) STRICT",
        t.name,
        parts.join(",\n  ")
    )
}

fn quoted(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("\"{n}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The DDL of an export, as `docs/export-schema.md` shows it.
pub fn ddl() -> String {
    let mut out = format!(
        "CREATE TABLE \"{META_TABLE}\" (\"key\" TEXT NOT NULL PRIMARY KEY, \"value\" TEXT NOT NULL) STRICT;\n"
    );
    for t in TABLES {
        out.push_str(&create_table_sql(t));
        out.push_str(";\n");
    }
    out
}

fn sqlite_error(path: &Path, e: rusqlite::Error) -> String {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase) => {
            format!("{} is not a SQLite database", path.display())
        }
        Some(rusqlite::ErrorCode::DatabaseBusy) | Some(rusqlite::ErrorCode::DatabaseLocked) => {
            format!("{} is in use by another program", path.display())
        }
        _ => format!("SQLite {}: {e}", path.display()),
    }
}

fn table_names(conn: &Connection, path: &Path) -> Result<Vec<String>, String> {
    let mut stmt = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
        .map_err(|e| sqlite_error(path, e))?;
    let names = stmt
        .query_map([], |r| r.get::<_, String>(0))
        .map_err(|e| sqlite_error(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| sqlite_error(path, e))?;
    Ok(names)
}

/// An export's berth tables are plain tables: a view or a virtual table of
/// the same name would run arbitrary SQL on every read (a recursive view
/// runs until the disk is full), and no berth export makes one.
fn only_plain_tables(conn: &Connection, path: &Path) -> Result<(), String> {
    let berth_names = TABLES.iter().map(|t| t.name).chain([META_TABLE]);
    for name in berth_names {
        let found: Option<(String, Option<String>)> = conn
            .query_row(
                "SELECT type, sql FROM sqlite_master WHERE name = ?1",
                [name],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map(Some)
            .or_else(|e| match e {
                rusqlite::Error::QueryReturnedNoRows => Ok(None),
                other => Err(other),
            })
            .map_err(|e| sqlite_error(path, e))?;
        if let Some((kind, sql)) = found {
            let is_virtual = sql.as_deref().is_some_and(|s| {
                s.trim_start()
                    .to_ascii_uppercase()
                    .starts_with("CREATE VIRTUAL")
            });
            if kind != "table" || is_virtual {
                return Err(format!(
                    "{}: {name} is a {} there, not a plain table; a berth export never makes one, so this file is refused",
                    path.display(),
                    if is_virtual { "virtual table" } else { kind.as_str() }
                ));
            }
        }
    }
    Ok(())
}

fn schema_version(conn: &Connection, path: &Path) -> Result<Option<u32>, String> {
    let text: Option<String> = conn
        .query_row(
            &format!("SELECT \"value\" FROM \"{META_TABLE}\" WHERE \"key\" = 'schema_version'"),
            [],
            |r| r.get(0),
        )
        .map(Some)
        .or_else(|e| match e {
            rusqlite::Error::QueryReturnedNoRows => Ok(None),
            e => Err(sqlite_error(path, e)),
        })?;
    Ok(text.and_then(|t| t.parse().ok()))
}

pub struct SqliteTarget {
    conn: Option<Connection>,
    path: PathBuf,
    /// Whether this export made the file (then a failure removes it).
    created: bool,
    committed: bool,
    insert: String,
}

impl SqliteTarget {
    pub fn open(path: &Path, replace: bool) -> Result<SqliteTarget, String> {
        let created = !path.exists();
        if created {
            // storage.md: an export holds every configuration, log, stored
            // answer and webhook secret: the file is made 0600, before
            // SQLite writes a byte into it.
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        }
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
        )
        .map_err(|e| sqlite_error(path, e))?;
        let mut target = SqliteTarget {
            conn: Some(conn),
            path: path.to_path_buf(),
            created,
            committed: false,
            insert: String::new(),
        };
        target.prepare(replace)?;
        Ok(target)
    }

    fn conn(&self) -> Result<&Connection, String> {
        self.conn
            .as_ref()
            .ok_or_else(|| "the SQLite connection is closed".to_string())
    }

    fn prepare(&mut self, replace: bool) -> Result<(), String> {
        let path = self.path.clone();
        let conn = self.conn()?;
        conn.execute_batch("PRAGMA foreign_keys = ON; BEGIN IMMEDIATE")
            .map_err(|e| sqlite_error(&path, e))?;
        let names = table_names(conn, &path)?;
        let version = if names.iter().any(|n| n == META_TABLE) {
            schema_version(conn, &path)?
        } else {
            None
        };
        let drop_ours = judge_target(&names, version, replace, &path.display().to_string())?;
        if drop_ours {
            for t in TABLES.iter().rev() {
                conn.execute_batch(&format!("DROP TABLE IF EXISTS \"{}\"", t.name))
                    .map_err(|e| sqlite_error(&path, e))?;
            }
            conn.execute_batch(&format!("DROP TABLE IF EXISTS \"{META_TABLE}\""))
                .map_err(|e| sqlite_error(&path, e))?;
        }
        conn.execute_batch(&ddl())
            .map_err(|e| sqlite_error(&path, e))?;
        Ok(())
    }
}

struct Param<'a>(&'a Value);

impl rusqlite::ToSql for Param<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match self.0 {
            Value::Null => ToSqlOutput::Borrowed(ValueRef::Null),
            Value::Text(s) | Value::Json(s) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
            Value::Bytes(b) => ToSqlOutput::Borrowed(ValueRef::Blob(b)),
            Value::Int(n) => ToSqlOutput::Owned(rusqlite::types::Value::Integer(*n)),
            Value::Bool(b) => ToSqlOutput::Owned(rusqlite::types::Value::Integer(i64::from(*b))),
            Value::Time(t) => ToSqlOutput::Owned(rusqlite::types::Value::Text(format_time(*t))),
            Value::Uuid(id) => {
                ToSqlOutput::Owned(rusqlite::types::Value::Text(format_build_id(*id)))
            }
        })
    }
}

impl Target for SqliteTarget {
    fn begin_table(&mut self, table: &'static RelTable) -> Result<(), String> {
        let marks = vec!["?"; table.columns.len()].join(", ");
        let names: Vec<&str> = table.columns.iter().map(|c| c.name).collect();
        self.insert = format!(
            "INSERT INTO \"{}\" ({}) VALUES ({marks})",
            table.name,
            quoted(&names)
        );
        Ok(())
    }

    fn row(&mut self, values: &[Value]) -> Result<(), String> {
        let path = self.path.clone();
        let conn = self.conn()?;
        let mut stmt = conn
            .prepare_cached(&self.insert)
            .map_err(|e| sqlite_error(&path, e))?;
        stmt.execute(rusqlite::params_from_iter(values.iter().map(Param)))
            .map_err(|e| sqlite_error(&path, e))?;
        Ok(())
    }

    fn end_table(&mut self) -> Result<(), String> {
        Ok(())
    }

    fn commit(mut self: Box<Self>, meta: &[(&str, String)]) -> Result<(), String> {
        let path = self.path.clone();
        let conn = self.conn()?;
        for (key, value) in meta {
            conn.execute(
                &format!("INSERT INTO \"{META_TABLE}\" (\"key\", \"value\") VALUES (?1, ?2)"),
                [key, value.as_str()],
            )
            .map_err(|e| sqlite_error(&path, e))?;
        }
        conn.execute_batch("COMMIT")
            .map_err(|e| sqlite_error(&path, e))?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for SqliteTarget {
    fn drop(&mut self) {
        // Closing without COMMIT rolls the transaction back.
        drop(self.conn.take());
        if !self.committed && self.created {
            let _ = std::fs::remove_file(&self.path);
            let mut journal = self.path.clone().into_os_string();
            journal.push("-journal");
            let _ = std::fs::remove_file(journal);
        }
    }
}

pub struct SqliteOrigin {
    conn: Connection,
    path: PathBuf,
    version: u32,
}

impl SqliteOrigin {
    pub fn open(path: &Path) -> Result<SqliteOrigin, String> {
        if !path.is_file() {
            return Err(format!("{} does not exist", path.display()));
        }
        let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)
            .map_err(|e| sqlite_error(path, e))?;
        // One read transaction: the import reads one state of the file.
        conn.execute_batch("BEGIN")
            .map_err(|e| sqlite_error(path, e))?;
        let names = table_names(&conn, path)?;
        only_plain_tables(&conn, path)?;
        let version = if names.iter().any(|n| n == META_TABLE) {
            schema_version(&conn, path)?
        } else {
            None
        };
        let version = judge_origin(&names, version, &path.display().to_string())?;
        Ok(SqliteOrigin {
            conn,
            path: path.to_path_buf(),
            version,
        })
    }
}

impl Origin for SqliteOrigin {
    fn version(&self) -> u32 {
        self.version
    }

    fn rows(
        &mut self,
        table: &'static RelTable,
        each: &mut dyn FnMut(Vec<Value>) -> Result<(), String>,
    ) -> Result<(), String> {
        let names: Vec<&str> = table.columns.iter().map(|c| c.name).collect();
        let sql = format!(
            "SELECT {} FROM \"{}\" ORDER BY {}",
            quoted(&names),
            table.name,
            quoted(table.primary_key)
        );
        let path = self.path.clone();
        let mut stmt = self
            .conn
            .prepare(&sql)
            .map_err(|e| sqlite_error(&path, e))?;
        let mut rows = stmt.query([]).map_err(|e| sqlite_error(&path, e))?;
        while let Some(row) = rows.next().map_err(|e| sqlite_error(&path, e))? {
            let mut values = Vec::with_capacity(table.columns.len());
            for (i, column) in table.columns.iter().enumerate() {
                let cell = row.get_ref(i).map_err(|e| sqlite_error(&path, e))?;
                values.push(read_cell(cell, column.ty).ok_or_else(|| {
                    format!(
                        "{}: {}.{} holds a value of the wrong type",
                        path.display(),
                        table.name,
                        column.name
                    )
                })?);
            }
            each(values)?;
        }
        Ok(())
    }
}

fn read_cell(cell: ValueRef<'_>, ty: Ty) -> Option<Value> {
    let text = |b: &[u8]| std::str::from_utf8(b).ok().map(str::to_string);
    Some(match (cell, ty) {
        (ValueRef::Null, _) => Value::Null,
        (ValueRef::Text(b), Ty::Text) => Value::Text(text(b)?),
        (ValueRef::Text(b), Ty::Json) => Value::Json(text(b)?),
        (ValueRef::Text(b), Ty::Time) => Value::Time(parse_time(&text(b)?)?),
        (ValueRef::Text(b), Ty::Uuid) => Value::Uuid(parse_build_id(&text(b)?)?),
        (ValueRef::Blob(b), Ty::Bytes) => Value::Bytes(b.to_vec()),
        (ValueRef::Integer(n), Ty::Int) => Value::Int(n),
        (ValueRef::Integer(n), Ty::Bool) => Value::Bool(n != 0),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::schema::EXPORT_SCHEMA_VERSION;

    #[test]
    fn the_ddl_creates_every_table() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(&ddl()).unwrap();
        let names = table_names(&conn, Path::new(":memory:")).unwrap();
        assert_eq!(names.len(), TABLES.len() + 1);
        assert_eq!(EXPORT_SCHEMA_VERSION, 8);
    }
}
