# A small berth source in pure Nix: no nixpkgs, derivations made with
# `builtins.derivation` and /bin/sh, so describe, eval and deploy run on any
# machine with Nix. It is what `berth deployer nix` expects of a source:
# a function of { configuration, deployment, suspended } giving `describe`,
# `nodes` (one per enabled application) and a `destroy` hook.
{ configuration ? { }, deployment ? "example", suspended ? false }:
let
  catalog = [
    { name = "mastodon"; subdomain = "social"; configurable = true; operator_toggled = false; }
    { name = "forgejo"; subdomain = "git"; configurable = true; operator_toggled = false; }
    { name = "matrix"; subdomain = "chat"; configurable = true; operator_toggled = false; }
  ];
  # An application that was called `fedi` is `mastodon` now.
  renames = [ { from = "/fedi"; to = "/mastodon"; } ];
  schema = {
    "$schema" = "https://json-schema.org/draft/2020-12/schema";
    type = "object";
    properties = {
      domain = { type = [ "string" "null" ]; maxLength = 253; };
      applications = {
        type = "object";
        maxProperties = 16;
        additionalProperties = {
          type = "object";
          properties = { enable = { type = "boolean"; }; };
        };
      };
    };
  };

  domain = configuration.domain or null;
  apps = configuration.applications or { };
  known = map (entry: entry.name) catalog;
  subdomainOf = name: (builtins.head (builtins.filter (entry: entry.name == name) catalog)).subdomain;
  unknown = builtins.filter (name: !(builtins.elem name known)) (builtins.attrNames apps);
  enabled = builtins.filter (name: (apps.${name} or { }).enable or false) known;

  # The source's own rules, beyond the schema: Nix's message is what the
  # user sees in the 422.
  checked =
    # Messages name no value of the request (berth's rule for errors).
    if unknown != [ ] then throw "an application this source does not know is configured; it knows ${builtins.concatStringsSep ", " known}"
    else if enabled != [ ] && domain == null then throw "an enabled application needs a domain"
    else true;

  # A derivation whose output is a file with `text`.
  file = name: text: builtins.derivation {
    inherit name text;
    system = builtins.currentSystem;
    builder = "/bin/sh";
    args = [ "-c" "printf '%s' \"$text\" > $out" ];
  };

  # Stands for `system.build.toplevel`: a directory with the node's
  # settings and a `bin/switch-to-configuration` that records what it
  # activates in the machine's state directory ($BERTH_EXAMPLE_STATE, or
  # ~/.local/state/berth-example): `active` (test, switch), `boot` (boot)
  # and a `history` of every call. Settings with `broken = true` give a
  # toplevel that comes up broken (it holds a `broken` file, which the
  # tests' systemctl stand-in reports as a failed unit).
  system = name: settings: text: builtins.derivation {
    name = "${deployment}-${name}-system";
    inherit text;
    broken = if settings.broken or false then "1" else "";
    system = builtins.currentSystem;
    builder = "/bin/sh";
    # mkdir, cat and chmod from the host: the example builds unsandboxed
    # (Debian's Nix); a NixOS source would use nixpkgs' stdenv instead.
    args = [ "-c" ''
      PATH=/run/current-system/sw/bin:/usr/bin:/bin
      mkdir -p $out/bin
      printf '%s' "$text" > $out/settings.json
      [ -n "$broken" ] && : > $out/broken
      cat > $out/bin/switch-to-configuration <<SCRIPT
      #!/bin/sh
      state="\''${BERTH_EXAMPLE_STATE:-\$HOME/.local/state/berth-example}"
      mkdir -p "\$state"
      echo "\$1 $out" >> "\$state/history"
      case "\$1" in
        test|switch) printf '%s\n' "$out" > "\$state/active" ;;
      esac
      case "\$1" in
        boot|switch) printf '%s\n' "$out" > "\$state/boot" ;;
      esac
      SCRIPT
      chmod +x $out/bin/switch-to-configuration
    '' ];
  };

  node = name:
    let
      host = "${subdomainOf name}.${domain}";
      settings = apps.${name};
    in {
      names = if suspended then [ ] else [ host ];
      # It changes exactly when this node's own settings do.
      toplevel = system name settings (builtins.toJSON { inherit name host settings suspended; });
      # Where the node is activated (an SSH destination), when the
      # configuration says.
      target = settings.target or null;
      # Stands for `system.build.sbom`: a CycloneDX document.
      sbom = file "${name}-sbom.cdx.json" (builtins.toJSON {
        bomFormat = "CycloneDX";
        specVersion = "1.5";
        version = 1;
        metadata.component = { type = "application"; name = name; version = "1.0.0"; };
        components = [
          { type = "application"; name = name; version = "1.0.0"; purl = "pkg:nix/${name}@1.0.0"; }
          { type = "library"; name = "openssl"; version = "3.0.15"; purl = "pkg:nix/openssl@3.0.15"; }
        ];
      });
    };
in
{
  describe = {
    methods = [ "nix" ];
    default_method = "nix";
    actions = { suspend = [ "nix" ]; resume = [ "nix" ]; };
    inherit catalog renames schema;
  };
  nodes = assert checked; builtins.listToAttrs (map (name: { inherit name; value = node name; }) enabled);
  destroy = file "${deployment}-destroy" "echo destroying ${deployment}";
}
