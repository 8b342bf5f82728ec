{{/* ---------------------------------------------------------------- names and labels */}}

{{- define "lance-sink.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "lance-sink.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "lance-sink.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lance-sink.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "lance-sink.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "lance-sink.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: sink
{{- end -}}

{{/* The query-only tier (serve.enabled): its objects are named <fullname>-serve. */}}
{{- define "lance-sink.serve.fullname" -}}
{{- printf "%s-serve" (include "lance-sink.fullname" . | trunc 57 | trimSuffix "-") -}}
{{- end -}}

{{/*
The serve pods' labels. app.kubernetes.io/name is <name>-serve, so the writers' selector
(name and instance, immutable on an installed release's StatefulSet or Deployment) does not
match serve pods, nor do the writers' Service, PodDisruptionBudget, NetworkPolicy and spread
constraints; and the serve selector does not match writer pods, which carry neither that name
nor a component label.
*/}}
{{- define "lance-sink.serve.selectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-serve" (include "lance-sink.name" . | trunc 57 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: serve
{{- end -}}

{{- define "lance-sink.serve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "lance-sink.serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "lance-sink.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "lance-sink.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository@digest when image.digest is set (the tag is then ignored), else repository:tag. */}}
{{- define "lance-sink.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Where the ConfigMap's sink.toml is mounted and what the container runs. */}}
{{- define "lance-sink.configDir" -}}/etc/lance-sink/config{{- end -}}

{{/* ---------------------------------------------------------------- the sink's config */}}

{{/*
The effective `config` as JSON: .Values.config with the TLS file locations filled in from the
mounted secret (only where the user left them null). Read it with `fromJson`.
*/}}
{{- define "lance-sink.config" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $tls := .Values.secrets.kafkaTls -}}
{{- if $tls.existingSecret -}}
{{- $kafka := $cfg.kafka -}}
{{- range $field, $key := dict "ssl_ca_location" $tls.caKey "ssl_certificate_location" $tls.certificateKey "ssl_key_location" $tls.keyKey -}}
{{- if and $key (kindIs "invalid" (index $kafka $field)) -}}
{{- $_ := set $kafka $field (printf "%s/%s" (trimSuffix "/" $tls.mountPath) $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toJson $cfg -}}
{{- end -}}

{{/*
One TOML value, inline: strings, numbers and booleans through toJson (JSON's escapes are valid
in TOML basic strings, and toJson prints integral numbers without an exponent, unlike toToml),
arrays as [..], maps as inline tables. null has no TOML form: keys holding it are left out
(the model's default applies), and a null inside an array is an error.
*/}}
{{- define "lance-sink.tomlValue" -}}
{{- $v := . -}}
{{- if kindIs "map" $v -}}
{{- $first := true -}}
{ {{- range $k, $x := $v -}}
{{- if not (kindIs "invalid" $x) -}}
{{- if not $first }},{{ end }} {{ include "lance-sink.tomlKey" $k }} = {{ include "lance-sink.tomlValue" $x -}}
{{- $first = false -}}
{{- end -}}
{{- end }} }
{{- else if kindIs "slice" $v -}}
[{{- range $i, $x := $v -}}
{{- if kindIs "invalid" $x -}}{{- fail "config: null is not allowed inside a list" -}}{{- end -}}
{{- if $i }}, {{ end }}{{ include "lance-sink.tomlValue" $x -}}
{{- end -}}]
{{- else -}}
{{- toJson $v -}}
{{- end -}}
{{- end -}}

{{- define "lance-sink.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{/* The whole sink.toml: one [section] per settings section, keys in name order. */}}
{{- define "lance-sink.toml" -}}
# Rendered by the lance-sink Helm chart from .Values.config; read by `lance-sink run --config`.
# Keys left out are unset (null in values): the settings model's default applies. Secrets
# come from the environment (LANCE_SINK__...), which takes precedence over this file.
{{- $cfg := include "lance-sink.config" . | fromJson }}
{{- range $section, $fields := $cfg }}

[{{ $section }}]
{{- range $k, $v := $fields }}
{{- if not (kindIs "invalid" $v) }}
{{ include "lance-sink.tomlKey" $k }} = {{ include "lance-sink.tomlValue" $v }}
{{- end }}
{{- end }}
{{- end }}
{{ end -}}

{{/* ---------------------------------------------------------------- derived numbers */}}

{{/*
Bytes of a size value as pydantic's ByteSize reads it: an integer, or a number with a unit
(B, K/KB, M/MB, G/GB, T/TB decimal; KiB, MiB, GiB, TiB binary; case-insensitive).
Call with (list "config.key" value).
*/}}
{{- define "lance-sink.bytes" -}}
{{- $key := index . 0 -}}
{{- $v := index . 1 -}}
{{- if or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v) -}}
{{- int64 $v -}}
{{- else -}}
{{- $s := lower (nospace (toString $v)) -}}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?[a-z]*$" $s) -}}
{{- fail (printf "%s: cannot read %q as a size (use bytes or e.g. 512MiB, 2GiB)" $key (toString $v)) -}}
{{- end -}}
{{- $num := regexReplaceAll "^([0-9.]+)([a-z]*)$" $s "${1}" -}}
{{- $unit := regexReplaceAll "^([0-9.]+)([a-z]*)$" $s "${2}" -}}
{{- $units := dict "" 1 "b" 1 "k" 1000 "kb" 1000 "m" 1000000 "mb" 1000000 "g" 1000000000 "gb" 1000000000 "t" 1000000000000 "tb" 1000000000000 "kib" 1024 "mib" 1048576 "gib" 1073741824 "tib" 1099511627776 -}}
{{- if not (hasKey $units $unit) -}}
{{- fail (printf "%s: unknown size unit %q in %q (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)" $key $unit (toString $v)) -}}
{{- end -}}
{{- mulf (float64 $num) (index $units $unit) | floor | int64 -}}
{{- end -}}
{{- end -}}

{{/*
Bytes of a Kubernetes quantity (resources.limits.memory): an integer, a decimal exponent
(129e6, 1e+09), or a number with a binary (Ki, Mi, Gi, Ti, Pi, Ei) or decimal (k, M, G, T, P, E)
suffix. Call with (list "values.key" value).
*/}}
{{- define "lance-sink.quantityBytes" -}}
{{- $key := index . 0 -}}
{{- $v := index . 1 -}}
{{- if or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v) -}}
{{- int64 $v -}}
{{- else -}}
{{- $s := toString $v -}}
{{- if regexMatch "^[0-9]+(\\.[0-9]+)?[eE]\\+?[0-9]+$" $s -}}
{{- $num := regexReplaceAll "^([0-9.]+)[eE]\\+?([0-9]+)$" $s "${1}" -}}
{{- $exp := regexReplaceAll "^([0-9.]+)[eE]\\+?0*([0-9]+)$" $s "${2}" | int -}}
{{- $scale := 1 -}}
{{- range until $exp -}}{{- $scale = mul $scale 10 -}}{{- end -}}
{{- mulf (float64 $num) $scale | floor | int64 -}}
{{- else if regexMatch "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$" $s -}}
{{- $num := regexReplaceAll "^([0-9.]+)([A-Za-z]*)$" $s "${1}" -}}
{{- $unit := regexReplaceAll "^([0-9.]+)([A-Za-z]*)$" $s "${2}" -}}
{{- $units := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 "E" 1000000000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "Ei" 1152921504606846976 -}}
{{- mulf (float64 $num) (index $units $unit) | floor | int64 -}}
{{- else -}}
{{- fail (printf "%s: cannot read %q as a Kubernetes memory quantity (use e.g. 4Gi, 3500Mi or 4G)" $key $s) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
MiB of memory the sink needs for its settings, an integer (the derived memory limit):
  ceil(process_budget_bytes x resources.memory.budgetFactor / 1 MiB) + resources.memory.overheadMiB
  + ceil(query.unindexed_cache_bytes / 1 MiB) when the query API is on and the table has a vector
  or full-text column
  + ceil((query.lance_index_cache_bytes + query.lance_metadata_cache_bytes) / 1 MiB) when the
  query API is on
  + resources.memory.maintenanceProcessMiB when maintenance runs in its child process
  + source.decode_workers x resources.memory.decodeProcessMiB when decoding runs in worker
  processes (source.decode_processes)
*/}}
{{- define "lance-sink.memoryNeedMiB" -}}
{{- $budget := include "lance-sink.bytes" (list "config.backpressure.process_budget_bytes" .Values.config.backpressure.process_budget_bytes) | float64 -}}
{{- $mib := divf (mulf $budget .Values.resources.memory.budgetFactor) 1048576 | ceil | int64 -}}
{{- $cache := include "lance-sink.queryCachesMiB" . | int64 -}}
{{- $maintenance := 0 -}}
{{- if and .Values.config.maintenance.enabled .Values.config.maintenance.process -}}
{{- $maintenance = int64 .Values.resources.memory.maintenanceProcessMiB -}}
{{- end -}}
{{- $decode := 0 -}}
{{- if .Values.config.source.decode_processes -}}
{{- $decode = mul (int64 .Values.config.source.decode_workers) (int64 .Values.resources.memory.decodeProcessMiB) -}}
{{- end -}}
{{- add $mib (int64 .Values.resources.memory.overheadMiB) $cache $maintenance $decode -}}
{{- end -}}

{{/*
MiB of the query API's caches, an integer (0 with the query API off); for a serve pod, called
with (list $ true):
  ceil(unindexed cache bytes / 1 MiB) when the table has a vector or full-text column (a
  serve pod's serve.unindexedCacheBytes unless null, else query.unindexed_cache_bytes)
  + ceil((query.lance_index_cache_bytes + query.lance_metadata_cache_bytes) / 1 MiB)
*/}}
{{- define "lance-sink.queryCachesMiB" -}}
{{- $root := . -}}
{{- $serve := false -}}
{{- if kindIs "slice" . -}}
{{- $root = index . 0 -}}
{{- $serve = index . 1 -}}
{{- end -}}
{{- with $root -}}
{{- $q := .Values.config.query -}}
{{- $cache := 0 -}}
{{- if and $q.enabled (or .Values.config.table.vector .Values.config.table.fts_columns) -}}
{{- $key := "config.query.unindexed_cache_bytes" -}}
{{- $bytes := $q.unindexed_cache_bytes -}}
{{- if and $serve (not (kindIs "invalid" .Values.serve.unindexedCacheBytes)) -}}
{{- $key = "serve.unindexedCacheBytes" -}}
{{- $bytes = .Values.serve.unindexedCacheBytes -}}
{{- end -}}
{{- $cacheBytes := include "lance-sink.bytes" (list $key $bytes) | float64 -}}
{{- $cache = divf $cacheBytes 1048576 | ceil | int64 -}}
{{- end -}}
{{- if $q.enabled -}}
{{- $index := include "lance-sink.bytes" (list "config.query.lance_index_cache_bytes" $q.lance_index_cache_bytes) | float64 -}}
{{- $metadata := include "lance-sink.bytes" (list "config.query.lance_metadata_cache_bytes" $q.lance_metadata_cache_bytes) | float64 -}}
{{- $cache = add $cache (divf (addf $index $metadata) 1048576 | ceil | int64) -}}
{{- end -}}
{{- $cache -}}
{{- end -}}
{{- end -}}

{{/*
MiB a serve pod needs, an integer (its derived memory limit): serve.resources.memory.overheadMiB
+ the query API's caches (lance-sink.queryCachesMiB). No budget, maintenance or decoding: it
consumes nothing and writes nothing.
*/}}
{{- define "lance-sink.serve.memoryNeedMiB" -}}
{{- add (int64 .Values.serve.resources.memory.overheadMiB) (include "lance-sink.queryCachesMiB" (list . true) | int64) -}}
{{- end -}}

{{/* A serve pod's memory limit: serve.resources.limits.memory when set (checked), else derived. */}}
{{- define "lance-sink.serve.memoryLimit" -}}
{{- if .Values.serve.resources.limits.memory -}}
{{- .Values.serve.resources.limits.memory -}}
{{- else -}}
{{- printf "%sMi" (include "lance-sink.serve.memoryNeedMiB" .) -}}
{{- end -}}
{{- end -}}

{{/*
The container memory limit: resources.limits.memory when set (the validation checks that the
budget fits in it), else derived from the backpressure budget (lance-sink.memoryNeedMiB, in Mi).
*/}}
{{- define "lance-sink.memoryLimit" -}}
{{- if .Values.resources.limits.memory -}}
{{- .Values.resources.limits.memory -}}
{{- else -}}
{{- printf "%sMi" (include "lance-sink.memoryNeedMiB" .) -}}
{{- end -}}
{{- end -}}

{{/* terminationGracePeriodSeconds: set (and checked) or ceil(drain deadline) + margin. */}}
{{- define "lance-sink.gracePeriod" -}}
{{- $drain := float64 .Values.config.shutdown.drain_deadline_s -}}
{{- $set := .Values.terminationGracePeriodSeconds -}}
{{- if not (kindIs "invalid" $set) -}}
{{- if le (float64 $set) $drain -}}
{{- fail (printf "terminationGracePeriodSeconds (%v) must be greater than config.shutdown.drain_deadline_s (%v): the kubelet would SIGKILL the sink mid-drain. Raise it or leave it null to derive drain + terminationGraceMarginSeconds." $set $drain) -}}
{{- end -}}
{{- int64 $set -}}
{{- else -}}
{{- add (ceil $drain | int64) (int64 .Values.terminationGraceMarginSeconds) -}}
{{- end -}}
{{- end -}}

{{/* KEDA's maxReplicaCount: min(keda.maxReplicaCount or partitions, partitions). */}}
{{- define "lance-sink.kedaMaxReplicas" -}}
{{- $partitions := int64 .Values.keda.partitions -}}
{{- $max := $partitions -}}
{{- if not (kindIs "invalid" .Values.keda.maxReplicaCount) -}}
{{- $max = min (int64 .Values.keda.maxReplicaCount) $partitions -}}
{{- end -}}
{{- $max -}}
{{- end -}}

{{/* Label matchers of this release's series in the alert rules. */}}
{{- define "lance-sink.metricSelector" -}}
{{- default (printf "job=%q,namespace=%q" (include "lance-sink.fullname" .) .Release.Namespace) .Values.monitoring.prometheusRule.metricSelector -}}
{{- end -}}
