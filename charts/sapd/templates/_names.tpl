{{/* Names and labels of the release's objects and of the stage Jobs. */}}

{{/* Names: "<release>-<component>" within `max` characters (63, a DNS label, unless given). A release
     name too long for that is cut and made unique again with 5 hex digits of its hash, so two long
     release names sharing a prefix never collide; the component part is never cut. */}}
{{- define "sapd.name" -}}
{{- $max := int (.max | default 63) -}}
{{- $rel := .root.Release.Name -}}
{{- if gt (add (len $rel) (len .component) 1) $max -}}
{{- $room := int (sub $max (add (len .component) 7)) -}}
{{- $rel = printf "%s-%s" ($rel | trunc $room | trimSuffix "-") (sha256sum .root.Release.Name | trunc 5) -}}
{{- end -}}
{{- printf "%s-%s" $rel .component -}}
{{- end -}}

{{/* The release name must be a DNS-1035 label: the chart names Services (`<release>-train`,
     `<release>-retriever`) and Jobs after it. Helm itself accepts dots ("sapd.alfworld"); the API server would
     refuse the Service later, so refuse the name here, before anything is created. */}}
{{- define "sapd.validateRelease" -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" .Release.Name) -}}
{{- fail (printf "release name %q: the chart names Services after it, which must be DNS-1035 labels (lowercase letters, digits and '-', starting with a letter): choose e.g. %q" .Release.Name (.Release.Name | lower | replace "." "-" | replace "_" "-")) -}}
{{- end -}}
{{- end -}}

{{- define "sapd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object (Helm's recommended set). */}}
{{- define "sapd.labels" -}}
app.kubernetes.io/name: sapd
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: sapd
helm.sh/chart: {{ include "sapd.chart" .root }}
{{- end -}}

{{- define "sapd.selectorLabels" -}}
app.kubernetes.io/name: sapd
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of a Job (or JobSet, or a CronJob's jobTemplate): the common ones, the round, Kueue's. */}}
{{- define "sapd.jobLabels" -}}
{{ include "sapd.labels" . }}
{{- if .round }}
sapd.io/round: {{ .round | quote }}
{{- end }}
{{- with .root.Values.kueue.queueName }}
kueue.x-k8s.io/queue-name: {{ . }}
{{- end }}
{{- with .root.Values.kueue.priorityClass }}
kueue.x-k8s.io/priority-class: {{ . }}
{{- end }}
{{- end -}}

{{/* "<release>-<stage>[-r<R>][-<values hash>]" with room for 4 round digits and `.hostSuffix` more
     characters (an Indexed Job's pods are named "<job>-<index>", a JobSet's "<js>-node-0-<index>"),
     so that every pod hostname stays a 63-character DNS label. */}}
{{- define "sapd.stageName" -}}
{{- $suffix := "" -}}
{{- if .manual -}}{{- $suffix = toJson .root.Values | sha256sum | trunc 5 -}}{{- end -}}
{{- $reserve := int (.hostSuffix | default 0) -}}
{{- if .round -}}{{- $reserve = add $reserve 6 -}}{{- end -}}
{{- if $suffix -}}{{- $reserve = add $reserve (add 1 (len $suffix)) -}}{{- end -}}
{{- $name := include "sapd.name" (dict "root" .root "component" .component "max" (sub 63 $reserve)) -}}
{{- if .round -}}{{- $name = printf "%s-r%s" $name .round -}}{{- end -}}
{{- if $suffix -}}{{- $name = printf "%s-%s" $name $suffix -}}{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "sapd.stageMeta" -}}
{{- $s := include "sapd.settings" . | fromYaml -}}
name: {{ include "sapd.stageName" . }}
labels:
  {{- include "sapd.jobLabels" . | nindent 2 }}
{{- with $s.jobAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
